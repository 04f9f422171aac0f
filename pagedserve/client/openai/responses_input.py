"""A Responses API request (`POST /v1/responses`) read into the chat request the shim already serves: the
`input` string or items become chat messages after a stored conversation's history (input_image parts the chat's
image_url parts), `instructions` a system message, function tools and `text.format` their chat forms; every
refusal names its field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.client.openai.errors import bad_request
from pagedserve.client.openai.image_parts import input_image_part
from pagedserve.client.openai.protocol import model_field, refuse_unknown_fields
from pagedserve.client.openai.reasoning.fields import EFFORTS

RESPONSES_FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "stream", "store", "previous_response_id", "metadata", "user",
    "include", "truncation", "top_k", "seed", "stop", "chat_template_kwargs", "thinking_token_budget",
    "ignore_eos",  # vLLM's extra sampling field (benchmarks ask for fixed output lengths)
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesInput:
    """What a Responses request asks, read: the chat body to serve, the messages a continuation renders, and
    the request's own settings echoed in the response object."""

    chat_body: dict
    history: list[dict]
    stream: bool
    store: bool
    echo: dict = field(default_factory=dict)


def read_responses_request(body: dict, previous: list[dict]) -> ResponsesInput:
    """Read `body`; `previous` is the history of its previous_response_id (empty without one)."""
    refuse_unknown_fields(body, RESPONSES_FIELDS)
    model = model_field(body)
    if body.get("include"):
        raise bad_request("'include' is not supported by pagedserve", "include")
    history = [*previous, *_input_messages(body.get("input"), previous)]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat: dict[str, Any] = {"model": model, "messages": messages}
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "parallel_tool_calls", "chat_template_kwargs",
                 "thinking_token_budget", "ignore_eos"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    _reasoning(body.get("reasoning"), chat)
    stream, store = body.get("stream", False), body.get("store", True)
    for name, value in (("stream", stream), ("store", store)):
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean", name)
    echo = {name: body.get(name) for name in ("instructions", "max_output_tokens", "temperature", "top_p",
                                              "previous_response_id", "reasoning", "metadata", "user")}
    return ResponsesInput(chat, history, stream, store, echo)


def _input_messages(items: Any, previous: list[dict]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of input items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _function_call(item, where, messages)
        elif kind == "function_call_output":
            messages.append(_function_output(item, where, [*previous, *messages]))
        elif kind != "reasoning":  # past reasoning is not rendered again, as templates drop it
            raise bad_request(f"'{where}.type' {kind!r} is not an input item pagedserve takes (message, "
                              "function_call, function_call_output, reasoning)", f"{where}.type")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"'{where}.role' must be one of {list(MESSAGE_ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = _parts(content, where)
    if not isinstance(content, (str, list)):
        raise bad_request(f"'{where}.content' must be a string or a list of content parts", f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _parts(content: list, where: str) -> str | list[dict]:
    """A message's parts: their text joined, or with images the chat parts in order (image_parts.py)."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append(input_image_part(part, at))
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad_request(f"'{at}' must be a text part (input_text or output_text) or an input_image", at)
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _function_call(item: dict, where: str, messages: list[dict]) -> None:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
        messages[-1]["tool_calls"].append(call)  # one assistant turn holds consecutive calls
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output(item: dict, where: str, before: list[dict]) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise bad_request(f"'{where}.call_id' must be a string", f"{where}.call_id")
    known = {call["id"] for message in before for call in message.get("tool_calls") or ()}
    if call_id not in known:
        raise bad_request(f"No tool call found for function call output with call_id {call_id!r}",
                          f"{where}.call_id")
    if not isinstance(output, str):
        output = json.dumps(output, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"'tools[{i}]' must be a function tool (the only tool type pagedserve serves)",
                              f"tools[{i}]")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # the chat parser checks the words and refuses the rest naming tool_choice


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad_request("'text' must be an object with a 'format' object", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise bad_request("'text.format' must be text, json_object, or json_schema with a 'schema' object",
                      "text.format")


def _reasoning(reasoning: Any, chat: dict) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise bad_request("'reasoning' must be an object with 'effort' and 'summary'", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"'reasoning.effort' must be one of {list(EFFORTS)}", "reasoning.effort")
        chat["reasoning_effort"] = effort
