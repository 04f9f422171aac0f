"""The outputs of a forced tool choice, which the engine's structured outputs hold to a JSON schema: a
list `[{"name": ..., "parameters": {...}}, ...]` for `required`, the arguments object for a named tool."""

from __future__ import annotations

from pagedserve.client.openai.tool_parsers.base import (
    CallGroup,
    Scan,
    ToolParser,
    json_call_group,
    scan_groups,
)


class RequiredToolParser(ToolParser):
    """`tool_choice: "required"`: the output is a JSON list of calls."""

    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        return scan_groups(text, final, "", lambda pos: json_call_group(text, pos, final, ",", bracketed=True),
                           bare_start=0)


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the output is that function's arguments, one JSON object."""

    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        def group_at(pos: int) -> CallGroup:
            return json_call_group(text, pos, final, None, bracketed=False, name=self.function_name)

        return scan_groups(text, final, "", group_at, bare_start=0)
