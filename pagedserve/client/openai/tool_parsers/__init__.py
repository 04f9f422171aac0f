"""Tool-call parsers, registered by name as vLLM's `--tool-call-parser` names them; each is one small class
with a non-streaming `parse(text)` and a streaming `stream()`, both answering from one `scan`."""

from __future__ import annotations

from pagedserve.client.openai.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Event,
    ToolCall,
    ToolParser,
    ToolStream,
)
from pagedserve.client.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedserve.client.openai.tool_parsers.hermes import HermesToolParser
from pagedserve.client.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.client.openai.tool_parsers.mistral import MistralToolParser
from pagedserve.client.openai.tool_parsers.pythonic import PythonicToolParser

# The parsers `--tool-call-parser` chooses among for `tool_choice: "auto"`.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}

__all__ = [
    "TOOL_PARSERS", "ArgumentsDelta", "CallStart", "ContentDelta", "Event", "NamedToolParser",
    "RequiredToolParser", "ToolCall", "ToolParser", "ToolStream",
]
