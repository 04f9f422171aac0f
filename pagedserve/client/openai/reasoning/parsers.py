"""The reasoning formats, by vLLM's `--reasoning-parser` names; each is its markers and whether thinking
starts without its start marker."""

from __future__ import annotations

from pagedserve.client.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: `<think>...</think>`; output without `<think>` is the answer (enable_thinking off)."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: the template opens `<think>`, so output is thinking until `</think>`."""

    name = "deepseek_r1"
    implicit_start = True


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5: `<think>...</think>` written by the model."""

    name = "glm45"


class Step3ReasoningParser(ReasoningParser):
    """Step3: thinking from the first token until `</think>`, with no start marker of its own."""

    name = "step3"
    implicit_start = True


class MistralReasoningParser(ReasoningParser):
    """Magistral: `[THINK]...[/THINK]`."""

    name = "mistral"
    start, end = "[THINK]", "[/THINK]"


class SeedOssReasoningParser(ReasoningParser):
    """Seed-OSS: `<seed:think>...</seed:think>`, thinking from the first token."""

    name = "seed_oss"
    start, end = "<seed:think>", "</seed:think>"
    implicit_start = True
