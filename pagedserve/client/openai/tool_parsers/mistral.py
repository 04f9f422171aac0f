"""Mistral (tokenizer v3 to v10): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

import secrets
import string
from functools import partial

from pagedserve.client.openai.tool_parsers.base import Scan, ToolParser, json_call_group, scan_groups

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """Content before `[TOOL_CALLS]`, then a JSON list of calls; from a list item that is not a call on,
    the text is content."""

    name = "mistral"

    def scan(self, text: str, final: bool) -> Scan:
        group_at = partial(json_call_group, text, final=final, separator=",", bracketed=True)
        return scan_groups(text, final, TOOL_CALLS, group_at)

    def new_call_id(self) -> str:
        """Nine letters and digits: Mistral's chat templates refuse a history whose call ids are not."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
