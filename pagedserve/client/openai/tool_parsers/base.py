"""What every tool-call parser shares: the call it finds, the streamed events, and the stream itself.

A parser's one method, `scan(text, final)`, says what is decided about a model's output so far: the
content and the calls. Decisions only grow as text arrives (a later scan extends an earlier one), so the
non-streamed answer (`parse`, one final scan) and the streamed one (`ToolStream`, the differences
between scans) are the same text and the same calls, byte for byte.
"""

from __future__ import annotations

import json
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger("pagedserve.openai.tools")

_DECODER = json.JSONDecoder()
# The argument keys models write: "arguments" (OpenAI, Hermes, Mistral) or "parameters" (Llama 3).
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text (json.dumps, ensure_ascii=False)."""

    name: str
    arguments: str


@dataclass
class Scan:
    """What is decided about an output so far: its content (text outside calls) and its calls, in order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    """Text of the assistant's content."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: its position among the output's calls and its function's name."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """A fragment of call `index`'s arguments; a call's fragments add up to its `arguments`."""

    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


class ToolParser(ABC):
    """A model family's tool-call format: `scan` decides, `parse` and `stream` answer from it."""

    name: ClassVar[str]

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """What is decided about `text`; with `final`, nothing more will come."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output's (content, calls); content is None when calls were made and nothing else was said."""
        scan = self.scan(text, final=True)
        if scan.calls and not scan.content.strip():
            return None, scan.calls
        return scan.content, scan.calls

    def stream(self) -> ToolStream:
        """A streaming parser for one output."""
        return ToolStream(self)

    def new_call_id(self) -> str:
        """A fresh id for a call this parser found, in OpenAI's form."""
        return "call_" + secrets.token_hex(12)


class ToolStream:
    """One output parsed as it streams: `feed` each text delta, then `finish`; each returns the new events.

    Content is held while what is decided of it is only whitespace (a call may follow, and then it is
    dropped); a call is sent whole once decided, its arguments in one fragment of their final form."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._content_sent = ""
        self._calls_sent = 0

    @property
    def called(self) -> bool:
        """Whether a call was sent."""
        return self._calls_sent > 0

    def feed(self, delta: str) -> list[Event]:
        """The events the output's next text brings."""
        self._text += delta
        return self._events(self._parser.scan(self._text, final=False), final=False)

    def finish(self) -> list[Event]:
        """The events left once the output has ended."""
        return self._events(self._parser.scan(self._text, final=True), final=True)

    def _events(self, scan: Scan, final: bool) -> list[Event]:
        events: list[Event] = []
        content = scan.content
        if content.strip() or (final and not scan.calls):
            if not content.startswith(self._content_sent):
                logger.warning("%s parser took back content it had decided; dropping the change", self._parser.name)
            elif len(content) > len(self._content_sent):
                events.append(ContentDelta(content[len(self._content_sent):]))
                self._content_sent = content
        for index in range(self._calls_sent, len(scan.calls)):
            call = scan.calls[index]
            events += [CallStart(index, call.name), ArgumentsDelta(index, call.arguments)]
        self._calls_sent = max(self._calls_sent, len(scan.calls))
        return events


def call_from_object(obj: Any, name: str | None = None) -> ToolCall | None:
    """A call from a decoded JSON object {"name", "arguments" | "parameters"}; None when it is not one.
    With `name` given, `obj` is the arguments themselves (a named tool choice's output)."""
    if name is None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        name = obj["name"]
        obj = next((obj[key] for key in ARGUMENT_KEYS if key in obj), {})
        if isinstance(obj, str):  # some models write the arguments as a JSON string
            try:
                obj = json.loads(obj)
            except ValueError:
                return None
    arguments = normalized_arguments(obj)
    return None if arguments is None else ToolCall(name, arguments)


def normalized_arguments(arguments: Any) -> str | None:
    """A call's arguments as the JSON text every path sends; None unless they are a JSON object."""
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # NaN, a key that is not a string, a Python value JSON has no form for
        return None


def json_value_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` and where it ends; None if none is complete there (yet)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def without_partial(text: str, marker: str) -> str:
    """`text` without its longest ending that could be the start of `marker` (held until it is known)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[:-size]
    return text


@dataclass
class CallGroup:
    """Calls written as consecutive JSON objects: the calls, where the group's text ends, and its status:
    "closed" (complete at `end`), "open" (more text may continue it) or "broken" (the text from `end` on is
    not a call: from the end of the last call, or None when the group holds no call)."""

    calls: list[ToolCall]
    end: int | None
    status: str


def json_call_group(text: str, pos: int, final: bool, separator: str | None, bracketed: bool,
                    name: str | None = None) -> CallGroup:
    """The calls written from `pos` as JSON objects: `[a, b]` when `bracketed`, else `a; b` (`separator`
    between them; None: one object only). With `name`, each object is that function's arguments."""
    calls: list[ToolCall] = []
    last_end: int | None = None
    if bracketed:
        pos = skip_space(text, pos)
        if pos == len(text):
            return CallGroup(calls, None, "broken" if final else "open")
        if text[pos] != "[":
            return CallGroup(calls, None, "broken")
        pos += 1
    while True:
        pos = skip_space(text, pos)
        found = json_value_at(text, pos) if text.startswith("{", pos) else None
        if found is None:
            incomplete = pos == len(text) or text[pos] == "{"
            if incomplete and not final:
                return CallGroup(calls, last_end, "open")
            if pos == len(text) and calls:  # a list the output ended before closing keeps its calls
                return CallGroup(calls, pos, "closed")
            return CallGroup(calls, last_end, "broken")
        call = call_from_object(found[0], name)
        if call is None:
            return CallGroup(calls, last_end, "broken")
        calls.append(call)
        last_end = found[1]
        pos = skip_space(text, last_end)
        if pos == len(text):
            return CallGroup(calls, last_end, "closed" if final else "open")
        if separator is not None and text[pos] == separator:
            pos += 1
        elif bracketed and text[pos] == "]":
            return CallGroup(calls, pos + 1, "closed")
        else:
            return CallGroup(calls, last_end, "broken" if bracketed else "closed")


def scan_groups(text: str, final: bool, marker: str, group_at: Callable[[int], CallGroup],
                bare_start: int | None = None) -> Scan:
    """Content before the first `marker`, then groups of calls, each after a `marker` (the first one at
    `bare_start` without it, when given); text between or after them is content unless it is only
    whitespace. `group_at(pos)` reads the group that starts at `pos`."""
    first, skip = (bare_start, 0) if bare_start is not None else (text.find(marker), len(marker))
    if first < 0:
        return Scan(text if final else without_partial(text, marker))
    scan = Scan(text[:first])
    while True:
        group = group_at(first + skip)
        scan.calls += group.calls
        if group.status == "open":
            return scan
        if group.status == "broken":
            scan.content += text[first if group.end is None else group.end:]
            return scan
        rest = text[group.end:]
        ahead = rest.lstrip()
        if marker and ahead.startswith(marker):
            first, skip = len(text) - len(ahead), len(marker)
            continue
        if final or (ahead and not marker.startswith(ahead)):
            scan.content += rest if rest.strip() else ""
        return scan
