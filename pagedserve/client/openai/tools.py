"""Tool calling on /v1/chat/completions, as vLLM serves it: the request's `tools`, `tool_choice` and
`parallel_tool_calls` checked; the JSON schema a forced choice holds the output to; the history's tool
calls and results; and each choice's calls in OpenAI's message and delta shapes."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.client.openai.errors import bad_request
from pagedserve.client.openai.fields import STRUCTURED_FIELDS
from pagedserve.client.openai.tool_parsers import (
    TOOL_PARSERS,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Event,
    NamedToolParser,
    RequiredToolParser,
    ToolCall,
    ToolParser,
    ToolStream,
)

# The message keys of tool calling, beside role, content and name.
MESSAGE_KEYS = ("tool_calls", "tool_call_id")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
CHOICE_WORDS = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolSettings:
    """The shim's tool flags, vLLM's: whether `auto` is served and with which parser, and whether a request
    with `tool_choice: "none"` shows its tools to the chat template (vLLM shows them unless told)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools as sent, and what it asks of them: `choice` is none, auto, required or named
    (then `function_name` is the tool's)."""

    tools: tuple[dict, ...]
    choice: str
    function_name: str | None = None
    parallel_tool_calls: bool = True


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """The request's tool fields checked (400 naming the field); None when it has no tools and no choice.
    As vLLM: `tool_choice` defaults to auto when tools are given, else none."""
    tools = _parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    raw = body.get("tool_choice")
    if raw is None and not tools:
        return None
    choice, name = _parse_choice("auto" if raw is None else raw)
    if choice != "none" and not tools:
        raise bad_request(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
    if name is not None and name not in {tool["function"]["name"] for tool in tools}:
        raise bad_request(f"'tool_choice' names the function {name!r}, which is not among 'tools'", "tool_choice")
    return ToolChoice(tuple(tools), choice, name, parallel is not False)


_KIND_WORDS = {str: "a string", dict: "a JSON Schema object", bool: "a boolean"}


def _parse_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list of function tools", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"'{where}' must be an object of type 'function' (the only tool type)", where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name")
        for key, kinds in (("description", str), ("parameters", dict), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kinds):
                raise bad_request(f"'{where}.function.{key}' must be {_KIND_WORDS[kinds]}", f"{where}.function.{key}")
    return tools


def _parse_choice(raw: Any) -> tuple[str, str | None]:
    if raw in CHOICE_WORDS:
        return raw, None
    if isinstance(raw, dict) and raw.get("type", "function") == "function":
        function = raw.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]:
            return "named", function["name"]
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                      '{"type": "function", "function": {"name": ...}}', "tool_choice")


def check_served(choice: ToolChoice | None, settings: ToolSettings) -> None:
    """`auto` is refused, as vLLM refuses it, unless the shim was started with a parser for it."""
    if choice is not None and choice.choice == "auto" and not (
            settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")


def template_tools(choice: ToolChoice | None, settings: ToolSettings) -> list[dict] | None:
    """The tools the chat template renders (None: none)."""
    if choice is None or not choice.tools or (choice.choice == "none" and settings.exclude_tools_when_tool_choice_none):
        return None
    return list(choice.tools)


def constraint(choice: ToolChoice | None) -> dict | None:
    """The engine's structured_outputs spec that holds a forced choice's output to its calls' schema, as
    vLLM builds it: the named tool's parameters, or for `required` a list of {name, parameters} (one item
    only unless parallel_tool_calls)."""
    if choice is None or choice.choice not in ("required", "named"):
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in choice.tools}
    if choice.choice == "named":
        return {"json": _parameters(functions[choice.function_name])}
    schemas, definitions = [], {}
    for name, function in functions.items():
        parameters = _parameters(function)
        for key, value in parameters.pop("$defs", {}).items():
            if definitions.setdefault(key, value) != value:
                raise bad_request(f"two tools define '$defs.{key}' differently", "tools")
        schemas.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                         "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": schemas}}
    if not choice.parallel_tool_calls:
        schema["maxItems"] = 1
    if definitions:  # references inside a tool's parameters point at the root, where they now are
        schema["$defs"] = definitions
    return {"json": schema}


def constrain(choice: ToolChoice | None, sampling: dict, renames: dict[str, str]) -> None:
    """Put a forced choice's schema into the request's sampling; refused beside another output constraint
    (as vLLM refuses it for a named tool), whose field is named."""
    spec = constraint(choice)
    if spec is None:
        return
    given = next((name for name in STRUCTURED_FIELDS if name in sampling), None)
    if given is not None:
        param = renames.get(given, given)
        raise bad_request(f"'{param}' cannot be combined with tool_choice {choice.choice!r}, which constrains "
                          "the output to its calls", param)
    sampling["structured_outputs"] = spec
    renames["structured_outputs"] = "tools"  # a schema the engine cannot compile came from the tools


def _parameters(function: dict) -> dict:
    return copy.deepcopy(function.get("parameters") or {"type": "object", "properties": {}})


def output_parser(choice: ToolChoice | None, settings: ToolSettings) -> ToolParser | None:
    """What reads the calls out of a choice's text: the forced formats, the `auto` parser, or nothing."""
    if choice is None or choice.choice == "none":
        return None
    if choice.choice == "required":
        return RequiredToolParser()
    if choice.choice == "named":
        return NamedToolParser(choice.function_name)
    return TOOL_PARSERS[settings.tool_call_parser]()


def parse_message_tool_fields(message: dict, where: str) -> dict:
    """An assistant message's `tool_calls` (arguments decoded to objects, as vLLM gives them to chat
    templates) or a tool message's `tool_call_id`, checked; {} when the message has neither."""
    role = message.get("role")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"'{where}.tool_call_id' must be a string", f"{where}.tool_call_id")
        return {"tool_call_id": call_id}
    if "tool_call_id" in message:
        raise bad_request(f"'{where}.tool_call_id' belongs on a tool message", f"{where}.tool_call_id")
    calls = message.get("tool_calls")
    if calls is None:
        return {}
    if role != "assistant" or not isinstance(calls, list):
        raise bad_request(f"'{where}.tool_calls' must be a list, on an assistant message", f"{where}.tool_calls")
    return {"tool_calls": [_history_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]}


def _history_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"'{where}.function.name' must be a string", f"{where}.function.name")
    arguments = function.get("arguments") or "{}"
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise bad_request(f"'{where}.function.arguments' must be a JSON object (as text)", f"{where}.function.arguments")
    entry = {"type": "function", "function": {"name": function["name"], "arguments": decoded}}
    if isinstance(call.get("id"), str):
        entry = {"id": call["id"], **entry}
    return entry


def finish_reason(called: bool, finish: str) -> str:
    """A choice's finish reason: "tool_calls" once it made calls, unless max_tokens cut it ("length" says the
    last call may be missing, as OpenAI reports it)."""
    return "tool_calls" if called and finish != "length" else finish


class ChoiceTools:
    """One choice's tool calls: its text parsed whole or as it streams, in OpenAI's shapes."""

    def __init__(self, parser: ToolParser, parallel_tool_calls: bool):
        self._parser = parser
        self._stream: ToolStream | None = None
        self._max_calls = None if parallel_tool_calls else 1  # parallel_tool_calls false: the first call only
        self.called = False

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """The content and the `tool_calls` of a whole choice."""
        content, calls = self._parser.parse(text)
        calls = calls[: self._max_calls]
        self.called = bool(calls)
        return content, [self._call_body(call) for call in calls]

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The deltas streamed for a choice's new text (and, when it has finished, what was held)."""
        if self._stream is None:
            self._stream = self._parser.stream()
        events = self._stream.feed(text) if text else []
        if finished:
            events += self._stream.finish()
        return [delta for event in events if (delta := self._delta(event)) is not None]

    def _call_body(self, call: ToolCall) -> dict:
        return {"id": self._parser.new_call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _delta(self, event: Event) -> dict | None:
        if isinstance(event, ContentDelta):
            return {"content": event.text}
        if self._max_calls is not None and event.index >= self._max_calls:
            return None
        if isinstance(event, CallStart):
            self.called = True
            function = {"name": event.name, "arguments": ""}
            call_id = self._parser.new_call_id()
            return {"tool_calls": [{"index": event.index, "id": call_id, "type": "function", "function": function}]}
        assert isinstance(event, ArgumentsDelta)
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


