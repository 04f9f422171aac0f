"""Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import json

from pagedserve.client.openai.tool_parsers.base import (
    Scan,
    ToolCall,
    ToolParser,
    call_from_object,
    without_partial,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Each `<tool_call>` block holding a call's JSON is a call (the last one may be left open by the end of
    the output). A block that holds none (bad JSON, no name) is content, as is text around the blocks unless
    it is whitespace next to a call."""

    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(START)
        if start < 0:
            return Scan(text if final else without_partial(text, START))
        scan = Scan(text[:start])
        held = ""  # whitespace after a block that was not a call: kept unless the next block is a call
        while True:
            close = text.find(END, start + len(START))
            if close < 0:  # an output that ended inside a block is still a call if it holds one, as vLLM reads it
                call = _call(text[start + len(START):]) if final else None
                if call is not None:
                    scan.calls.append(call)
                elif final:
                    scan.content += held + text[start:]
                return scan
            end = close + len(END)
            call = _call(text[start + len(START):close])
            if call is not None:
                scan.calls.append(call)
            else:
                scan.content += held + text[start:end]
            start = text.find(START, end)
            gap = text[end:] if start < 0 else text[end:start]
            if start < 0:
                visible = gap if final else without_partial(gap, START)
                if visible.strip() or (final and call is None):
                    scan.content += visible
                return scan
            held = "" if gap.strip() == "" and call is not None else gap
            if gap.strip():
                scan.content += gap
                held = ""


def _call(body: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(body))
    except (ValueError, RecursionError):
        return None
