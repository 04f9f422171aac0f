"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`, optionally after
`<|python_tag|>`."""

from __future__ import annotations

from functools import partial

from pagedserve.client.openai.tool_parsers.base import (
    Scan,
    ToolParser,
    json_call_group,
    scan_groups,
    skip_space,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Calls when the output opens with a JSON object (after whitespace) or has `<|python_tag|>` (the text
    before it is content); an object that is not a call, and the text after the last call, are content."""

    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        group_at = partial(json_call_group, text, final=final, separator=";", bracketed=False)
        lead = skip_space(text, 0)
        if lead == len(text) and not final:
            return Scan()
        bare = lead if text.startswith("{", lead) else None
        return scan_groups(text, final, PYTHON_TAG, group_at, bare_start=bare)
