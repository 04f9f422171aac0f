"""Reasoning parsers, registered by name as vLLM's `--reasoning-parser` names them: each splits a model's
thinking from its answer (`reasoning` / `reasoning_content` beside `content`)."""

from __future__ import annotations

from pagedserve.client.openai.reasoning.base import Phase, ReasoningParser, ReasoningStream, Split
from pagedserve.client.openai.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    MistralReasoningParser,
    Qwen3ReasoningParser,
    SeedOssReasoningParser,
    Step3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, Glm45ReasoningParser, Step3ReasoningParser,
                   MistralReasoningParser, SeedOssReasoningParser)
}

__all__ = ["REASONING_PARSERS", "Phase", "ReasoningParser", "ReasoningStream", "Split"]
