"""vLLM's /tokenize and /detokenize: the served model's own tokenizer (and chat template) over HTTP."""

from __future__ import annotations

from typing import Any

from pagedserve.client.openai.errors import bad_request
from pagedserve.client.openai.protocol import MAX_TOKEN_ID, model_field, parse_messages, refuse_unknown_fields
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.openai.tools import parse_tool_choice

TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs"}


async def tokenize(shim: OpenAIShim, body: dict) -> dict:
    """{count, max_model_len, tokens[, token_strs]} of a prompt, or of messages (and tools) rendered by the
    template."""
    refuse_unknown_fields(body, TOKENIZE_FIELDS)
    await shim.resolve_model(model_field(body))  # an adapter's tokenizer is the base model's
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string", "prompt")
        text, special = body["prompt"], _flag(body, "add_special_tokens", True)
    else:
        messages = parse_messages(body["messages"])
        choice = parse_tool_choice({"tools": body["tools"]}) if body.get("tools") is not None else None
        text = (await shim.chat_template()).render(messages, _flag(body, "add_generation_prompt", True),
                                                   tools=list(choice.tools) if choice is not None else None)
        special = _flag(body, "add_special_tokens", False)  # the template holds them, as in chat requests
    tokenizer = await shim.tokenizer()
    encoding = tokenizer.encode(text, add_special_tokens=special)
    answer: dict[str, Any] = {"count": len(encoding.ids), "max_model_len": await shim.max_model_len(),
                              "tokens": encoding.ids}
    if _flag(body, "return_token_strs", False):
        answer["token_strs"] = encoding.tokens
    return answer


async def detokenize(shim: OpenAIShim, body: dict) -> dict:
    """{prompt} of token ids."""
    refuse_unknown_fields(body, {"model", "tokens"})
    await shim.resolve_model(model_field(body))  # an adapter's tokenizer is the base model's
    tokens = body.get("tokens")
    if (not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
            or not all(0 <= t <= MAX_TOKEN_ID for t in tokens)):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    tokenizer = await shim.tokenizer()
    if any(t >= tokenizer.get_vocab_size() for t in tokens):
        raise bad_request(f"'tokens' ids must be < the vocabulary size ({tokenizer.get_vocab_size()})", "tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value
