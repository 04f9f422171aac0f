"""Anthropic's Messages API read into the chat request the shim serves, and its error shape.

`system`, `messages` with text / image (base64 sources) / tool_use / tool_result (/ thinking, not rendered again)
blocks, `tools` (input_schema), `tool_choice` (auto / any / tool / none), `max_tokens` (required), `stop_sequences`,
`temperature`, `top_p`, `top_k`, `thinking` (enabled with budget_tokens: the template opens the thinking and
the budget forces its end; disabled: closed in the prompt). Every refusal names its field."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.client.openai.errors import APIError, bad_request
from pagedserve.client.openai.image_parts import anthropic_image_part
from pagedserve.client.openai.protocol import refuse_unknown_fields

MESSAGES_FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                   "stream", "tools", "tool_choice", "thinking", "metadata", "service_tier",
                   "ignore_eos"}  # vLLM's extra sampling field (benchmarks ask for fixed output lengths)
COUNT_FIELDS = MESSAGES_FIELDS - {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                                  "metadata", "service_tier", "ignore_eos"}
# Anthropic's error type of each HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error(error: APIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, the field named in the message."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message if error.param is None or error.param in error.message else \
        f"{error.param}: {error.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def chat_body(body: dict, counting: bool = False) -> dict:
    """The chat request of a Messages body (refused naming the field)."""
    refuse_unknown_fields(body, COUNT_FIELDS if counting else MESSAGES_FIELDS)
    if not counting and body.get("max_tokens") is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if not counting:
        chat["max_tokens"] = body["max_tokens"]
        for name in ("temperature", "top_p", "top_k", "stream", "ignore_eos"):
            if body.get(name) is not None:
                chat[name] = body[name]
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
            chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    chat.update(_thinking(body.get("thinking"), counting))
    return chat


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        system = _texts(system, "system")
    if not isinstance(system, str):
        raise bad_request("system must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": system}]


def _texts(blocks: list, where: str) -> str:
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}.{j}: must be a text block", f"{where}.{j}")
    return "".join(block["text"] for block in blocks)


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list", "messages")
    chat: list[dict] = []
    calls: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be 'user' or 'assistant'", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            chat += _blocks(message["role"], content, f"{where}.content", calls)
        else:
            raise bad_request(f"{where}.content: must be a string or a list of blocks", f"{where}.content")
    return chat


def _blocks(role: str, blocks: list, where: str, calls: set[str]) -> list[dict]:
    texts, tool_calls, results = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            texts.append(anthropic_image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            tool_calls.append(_tool_use(block, at))
            calls.add(block["id"])
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at, calls))
        elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
            raise bad_request(f"{at}.type: {kind!r} is not a {role} block pagedserve takes", f"{at}.type")
    # Text blocks joined; with images, the chat's parts in order (image_parts.py).
    text = texts if any(part["type"] == "image_url" for part in texts) else "".join(p["text"] for p in texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, **({"tool_calls": tool_calls} if tool_calls else {})}]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _tool_use(block: dict, at: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad_request(f"{at}: tool_use needs a string id and name", f"{at}.id")
    if not isinstance(block.get("input"), dict):
        raise bad_request(f"{at}.input: must be an object", f"{at}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict, at: str, calls: set[str]) -> dict:
    call_id = block.get("tool_use_id")
    if call_id not in calls:
        raise bad_request(f"{at}.tool_use_id: unexpected tool_use_id {call_id!r}: no tool_use block with this id "
                          "comes before it", f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = _texts(content, f"{at}.content")
    if not isinstance(content, str):
        raise bad_request(f"{at}.content: must be a string or text blocks", f"{at}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list", "tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                not isinstance(tool.get("input_schema"), dict) or tool.get("type", "custom") != "custom":
            raise bad_request(f"tools.{i}: a tool needs a name and an input_schema (client tools only)",
                              f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> dict:
    kind = choice.get("type") if isinstance(choice, dict) else None
    words = {"auto": "auto", "any": "required", "none": "none"}
    if kind in words:
        chat: dict[str, Any] = {"tool_choice": words[kind]}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise bad_request("tool_choice: must be auto, any, tool (with a name) or none", "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    return chat


def _thinking(thinking: Any, counting: bool) -> dict:
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise bad_request("thinking: must be {type: enabled, budget_tokens: int} or {type: disabled}",
                          "thinking")
    kwargs = {"chat_template_kwargs": {"enable_thinking": True, "thinking": True}}
    return kwargs if counting else {**kwargs, "thinking_token_budget": budget}
