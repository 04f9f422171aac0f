"""vLLM's chat-only request fields: how the template renders the messages (add_generation_prompt,
continue_final_message, chat_template_kwargs) and echo of the final assistant message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.client.openai.errors import bad_request

CHAT_OPTION_FIELDS = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs", "echo"}
# Names the template gets from the shim itself; a kwarg may not shadow them.
_RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "bos_token", "eos_token", "add_generation_prompt"}


@dataclass(frozen=True)
class ChatOptions:
    """How the messages become the prompt, and whether the answer repeats the final assistant message."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    echo: bool = False


def parse_chat_options(body: dict, messages: list[dict]) -> ChatOptions:
    """The chat options of a body, refused naming the field; continuing needs a final assistant message."""
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False), ("echo", False)):
        value = body.get(name, default)
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean, got {type(value).__name__}", name)
        flags[name] = value
    if flags["continue_final_message"] and flags["add_generation_prompt"]:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    if flags["continue_final_message"] and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs the last message to be the assistant's",
                          "continue_final_message")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    shadowed = sorted(set(kwargs) & _RESERVED_TEMPLATE_NAMES)
    if shadowed:
        raise bad_request(f"'chat_template_kwargs' may not set {shadowed[0]!r} (give it as a request field)",
                          "chat_template_kwargs")
    return ChatOptions(flags["add_generation_prompt"], flags["continue_final_message"], dict(kwargs),
                       flags["echo"])


def echoed_text(options: ChatOptions, messages: list[dict]) -> str:
    """What the answer starts with under echo: the final message's content when it is the assistant's
    (as vLLM echoes it), else nothing."""
    if options.echo and messages and messages[-1]["role"] == "assistant":
        return messages[-1].get("content") or ""
    return ""


def cut_after_final_message(rendered: str, final_message: str) -> str:
    """The rendered chat ending right after the final message's text, so the model continues it (as
    transformers' continue_final_message cuts it); refused when the template dropped that text."""
    stripped = final_message.strip()
    at = rendered.rfind(stripped) if stripped else -1
    if at < 0:
        raise bad_request("'continue_final_message' is set but the chat template does not keep the final "
                          "message's text", "continue_final_message")
    whole = final_message.lstrip()
    if rendered[at:at + len(whole)] == whole:  # the template kept the message's trailing space
        return rendered[:at + len(whole)]
    return rendered[:at + len(stripped)]
