"""Tool-call parsers over canned model outputs: the whole answer, and the same output streamed in pieces cut
at every boundary (all two-way cuts, hypothesis-drawn many-way cuts, one character at a time), which must
give the same content and the same calls byte for byte; malformed calls come back as content."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.client.openai.tool_parsers import (
    TOOL_PARSERS,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    NamedToolParser,
    RequiredToolParser,
    ToolCall,
    ToolParser,
)


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


WEATHER = _call("get_weather", city="Paris", unit="celsius")
ZURICH = _call("get_weather", city="Zürich 🙂", days=3)
TIME = _call("get_time")
NESTED = _call("book", guests=[{"name": "Ana", "age": 30}], flags={"late": True, "note": None}, price=-1.5)

# (text, content, calls) per parser: content None when calls were made and nothing else was said.
CANNED: dict[str, list[tuple[str, str | None, list[ToolCall]]]] = {
    "hermes": [
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         None, [WEATHER]),
        ('Let me look.\n<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}</tool_call>',
         "Let me look.\n", [WEATHER]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🙂", "days": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None, [ZURICH, TIME]),
        ('<tool_call>{"name": "book", "arguments": {"guests": [{"name": "Ana", "age": 30}], '
         '"flags": {"late": true, "note": null}, "price": -1.5}}</tool_call>', None, [NESTED]),
        ('<tool_call>{"name": "get_time"}</tool_call>\nDone.', "\nDone.", [TIME]),
        ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', None, [TIME]),  # arguments as text
        ('<tool_call>{"name": "get_time", "arguments": {}}', None, [TIME]),  # the output ended inside the block
        # Malformed blocks are content; whitespace beside a good call is not.
        ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>{"name": "f", "arguments": {</tool_call>', []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ("Sure <tool_call>{\"name\": \"f\", ", "Sure <tool_call>{\"name\": \"f\", ", []),
        ('<tool_call>oops</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         "<tool_call>oops</tool_call>", [TIME]),
        ("<tool_call>a</tool_call>\n<tool_call>b</tool_call>", "<tool_call>a</tool_call>\n<tool_call>b</tool_call>", []),
        ("a <tool_c", "a <tool_c", []),
        ("", "", []),
        ("\n", "\n", []),
    ],
    "mistral": [
        ("Paris.", "Paris.", []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [WEATHER]),
        ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich 🙂", "days": 3}}, '
         '{"name": "get_time", "arguments": {}}]', "Checking. ", [ZURICH, TIME]),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}][TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
         None, [TIME, TIME]),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}', None, [TIME]),  # ended before the list closed
        ('[TOOL_CALLS][{"name": "f", "arguments": }]', '[TOOL_CALLS][{"name": "f", "arguments": }]', []),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"x": 1}]', ', {"x": 1}]', [TIME]),
        ("[TOOL", "[TOOL", []),
    ],
    "llama3_json": [
        ("Paris is the capital.", "Paris is the capital.", []),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Zürich 🙂", "days": 3}}; '
         '{"name": "get_time", "parameters": {}}', None, [ZURICH, TIME]),
        ('Let me check. <|python_tag|>{"name": "get_time", "parameters": {}}', "Let me check. ", [TIME]),
        ('{"name": "get_time", "parameters": {}} and then', " and then", [TIME]),
        ('{"name": "get_time", "parameters": {}}; ', None, [TIME]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("<|python_tag|>not json", "<|python_tag|>not json", []),
        ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
        ('{"name": "f", "parameters": NaN}', '{"name": "f", "parameters": NaN}', []),
    ],
    "pythonic": [
        ("Paris.", "Paris.", []),
        ('[get_weather(city="Paris", unit="celsius")]', None, [WEATHER]),
        ("[get_weather(city='Zürich 🙂', days=3), get_time()]", None, [ZURICH, TIME]),
        ('[book(guests=[{"name": "Ana", "age": 30}], flags={"late": True, "note": None}, price=-1.5)]', None, [NESTED]),
        ("<|python_start|>[get_time()]<|python_end|>", None, [TIME]),
        ("  [get_time()]\n", None, [TIME]),
        ("[link](https://example.com)", "[link](https://example.com)", []),
        ("[get_time(1)]", "[get_time(1)]", []),  # positional arguments
        ("[get_time()] and more", "[get_time()] and more", []),
        ("[f(a=open('x'))]", "[f(a=open('x'))]", []),  # only literals, never evaluated
        ("[f(a=1+2j)]", "[f(a=1+2j)]", []),  # a value JSON has no form for
        ("[]", "[]", []),
        ("[f(a=1),", "[f(a=1),", []),
        ("[ # comment\n f()]", "[ # comment\n f()]", []),
        ("[os.system(a='x')]", "[os.system(a='x')]", []),
    ],
}
FORCED: list[tuple[ToolParser, str, str | None, list[ToolCall]]] = [
    (RequiredToolParser(), '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}]', None, [WEATHER]),
    (RequiredToolParser(), '[{"name":"get_time","parameters":{}},{"name":"get_time","parameters":{}}]', None, [TIME, TIME]),
    (RequiredToolParser(), '[{"name":"get_weather","parameters":{"city":"Par', '[{"name":"get_weather","parameters":{"city":"Par', []),
    (NamedToolParser("get_weather"), '{"city":"Paris","unit":"celsius"}', None, [WEATHER]),
    (NamedToolParser("get_time"), '{}', None, [TIME]),
    (NamedToolParser("get_time"), '{"cut', '{"cut', []),
]
CASES = [(TOOL_PARSERS[name](), *case) for name, cases in CANNED.items() for case in cases] + FORCED
IDS = [f"{parser.name}-{i}" for i, (parser, *_) in enumerate(CASES)]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """The content and calls a client assembles from the parser's events, checking their order."""
    stream = parser.stream()
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text, "no empty content deltas"
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls), "calls start once each, in order"
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ArgumentsDelta) and event.index == len(calls) - 1
            calls[event.index][1] += event.text
    assert stream.called == bool(calls)
    return content, [ToolCall(name, arguments) for name, arguments in calls]


def _whole(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    content, calls = parser.parse(text)
    return content or "", calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=IDS)
def test_parse_finds_the_calls_and_the_content(parser, text, content, calls):
    assert parser.parse(text) == (content, calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES, ids=IDS)
def test_every_two_way_cut_streams_what_parse_returns(parser, text, content, calls):
    whole = _whole(parser, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == whole, f"cut at {cut}: {text[:cut]!r}"
    assert streamed(parser, list(text)) == whole


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_cuts_stream_what_parse_returns(case, cuts):
    parser, text, *_ = case
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(points, points[1:], strict=False)]
    assert streamed(parser, pieces) == _whole(parser, text)


def _json_values() -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


_NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True).filter(lambda name: not keyword.iskeyword(name))
_CALLS = st.lists(st.tuples(_NAMES, st.dictionaries(_NAMES, _json_values(), max_size=3)), min_size=1, max_size=3)
_PROSE = st.text(st.characters(blacklist_characters="<[{"), max_size=20)


def _written(fmt: str, calls: list[tuple[str, dict]], before: str) -> str:
    """Calls as each model family writes them, after some content."""
    if fmt == "hermes":
        blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls]
        return before + "\n".join(blocks)
    if fmt == "mistral":
        return before + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "llama3_json":
        return before + "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(sorted(TOOL_PARSERS)), calls=_CALLS, before=_PROSE, cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_drawn_calls_come_back_whole_and_streamed(fmt, calls, before, cuts):
    text = _written(fmt, calls, before)
    parser = TOOL_PARSERS[fmt]()
    content, found = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in found)
    if fmt != "pythonic":
        assert content == (before if before.strip() else None)
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    assert streamed(parser, [text[a:b] for a, b in zip(points, points[1:], strict=False)]) == _whole(parser, text)


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(sorted(TOOL_PARSERS)), text=st.lists(st.sampled_from(list('<>[]{}()":;,= \nabx_1') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"', '"arguments"']), max_size=40).map("".join))
def test_garbage_never_raises_and_streams_as_parsed(fmt, text):
    parser = TOOL_PARSERS[fmt]()
    content, calls = parser.parse(text)
    if not calls:
        assert content == text
    assert streamed(parser, list(text)) == _whole(parser, text)


def test_call_ids_are_openai_style_and_mistral_ones_nine_letters_and_digits():
    ids = {TOOL_PARSERS["hermes"]().new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    mistral = {TOOL_PARSERS["mistral"]().new_call_id() for _ in range(50)}
    assert len(mistral) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in mistral)
