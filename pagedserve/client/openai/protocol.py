"""OpenAI request bodies translated for the `llm` model, and their validation.

Every refusal is a 400 naming the OpenAI field (`param`) at fault; the sampling fields are checked with the
engine's own rules, so a request the shim accepts is one the engine accepts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.request import check_priority
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.client.openai.chat_options import ChatOptions, parse_chat_options
from pagedserve.client.openai.errors import bad_request, refusal
from pagedserve.client.openai.fields import (
    CHAT_FIELDS,
    CHAT_ROLES,
    COMPLETION_FIELDS,
    KIND_WORDS,
    SAMPLING_FIELDS,
    STRUCTURED_FIELDS,
)
from pagedserve.client.openai.images import image_part_text, message_images
from pagedserve.client.openai.reasoning.choice import ReasoningRequest
from pagedserve.client.openai.reasoning.fields import (
    REASONING_KEYS,
    ReasoningFields,
    history_reasoning,
    parse_reasoning_fields,
)
from pagedserve.client.openai.tools import (
    MESSAGE_KEYS,
    ToolChoice,
    constrain,
    parse_message_tool_fields,
    parse_tool_choice,
)

logger = logging.getLogger("pagedserve.openai")

OPENAI_DEFAULT_COMPLETION_MAX_TOKENS = 16
# Token ids travel to the llm model as INT32.
MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class StreamOptions:
    """stream_options: a usage chunk at the end, and usage on every chunk as well."""

    include_usage: bool = False
    continuous_usage: bool = False


@dataclass
class GenerationRequest:
    """An OpenAI request translated for the `llm` model: one Triton request per prompt."""

    model: str
    prompts: list[str | list[int]]
    sampling: dict[str, Any]
    stream: bool = False
    stream_options: StreamOptions = field(default_factory=StreamOptions)
    logprobs: int | None = None  # top logprobs per token; None: no logprobs returned
    # Whether the tokenizer adds its special tokens (a BOS) to a text prompt: vLLM's extra field, true for
    # completions, false for chat (the rendered template holds them already).
    add_special_tokens: bool = True
    # Engine fields this request sent under another OpenAI name, for its refusals' `param`.
    param_renames: dict[str, str] = field(default_factory=dict)
    # Stream from the llm model even for a whole reply: per-step token counts (a reasoning's token count).
    stream_upstream: bool = False

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.stream_options.include_usage

    @property
    def n(self) -> int:
        """Completions per prompt."""
        return int(self.sampling.get("n", 1))


@dataclass
class CompletionRequest(GenerationRequest):
    """A /v1/completions request."""

    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs), nothing generated


@dataclass
class ChatRequest(GenerationRequest):
    """A /v1/chat/completions request; `prompts` is empty until its messages are rendered."""

    messages: list[dict] = field(default_factory=list)
    tools: ToolChoice | None = None  # tools, tool_choice and parallel_tool_calls
    options: ChatOptions = field(default_factory=ChatOptions)
    reasoning_fields: ReasoningFields = field(default_factory=ReasoningFields)
    reasoning: ReasoningRequest | None = None  # the split of thinking from answer, once the prompt is rendered
    images: list[str] = field(default_factory=list)  # base64 image files of image_url parts, in order
    image_params: list[str] = field(default_factory=list)  # each image's url field name


def parse_completion_request(body: dict) -> CompletionRequest:
    """Translate a /v1/completions body; raises APIError(400) naming the bad field."""
    _check_known_fields(body, COMPLETION_FIELDS)
    model, sampling, stream, stream_options = _common(body)
    if "prompt" not in body:
        raise bad_request("you must provide a prompt", "prompt")
    prompts = parse_prompts(body["prompt"])
    max_tokens = _typed(body, "max_tokens", (int,))
    echo = bool(_typed(body, "echo", (bool,)))
    echo_only = echo and max_tokens == 0
    if echo_only:  # as vLLM: the engine makes one token, which is not returned
        max_tokens = 1
    sampling["max_tokens"] = OPENAI_DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    logprobs = _typed(body, "logprobs", (int,))
    if logprobs is not None:
        sampling["logprobs"] = logprobs
        if echo:  # the echoed prompt's tokens get logprobs too (what lm-evaluation-harness scores with)
            sampling["prompt_logprobs"] = logprobs
    best_of = _typed(body, "best_of", (int,))
    if best_of is not None and best_of != sampling.get("n", 1):
        raise bad_request("'best_of' different from 'n' is not supported", "best_of")
    request = CompletionRequest(
        model, prompts, sampling, stream, stream_options, logprobs, _add_special_tokens(body, default=True),
        param_renames={"prompt_logprobs": "logprobs", **_structured_renames(body)}, echo=echo,
        echo_only=echo_only,
    )
    _validate_sampling(request)
    return request


def parse_chat_request(body: dict) -> ChatRequest:
    """Translate a /v1/chat/completions body (messages kept for the chat template)."""
    _check_known_fields(body, CHAT_FIELDS)
    model, sampling, stream, stream_options = _common(body)
    messages = parse_messages(body.get("messages"))
    max_tokens = _typed(body, "max_tokens", (int,))
    max_completion_tokens = _typed(body, "max_completion_tokens", (int,))
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise bad_request("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    # OpenAI's chat default is "until the context is full": None means up to max_model_len.
    sampling["max_tokens"] = max_completion_tokens if max_completion_tokens is not None else max_tokens
    renames = {"logprobs": "top_logprobs", **_structured_renames(body)}
    if max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    logprobs = None
    top_logprobs = _typed(body, "top_logprobs", (int,))
    if _typed(body, "logprobs", (bool,)):
        logprobs = top_logprobs or 0
        sampling["logprobs"] = logprobs
    elif top_logprobs is not None:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request("'metadata' must be an object", "metadata")
        logger.debug("chat request metadata %r (nothing is stored)", metadata)
    tools = parse_tool_choice(body)
    constrain(tools, sampling, renames)
    request = ChatRequest(model, [], sampling, stream, stream_options, logprobs,
                          _add_special_tokens(body, default=False), param_renames=renames, messages=messages,
                          tools=tools, options=parse_chat_options(body, messages),
                          reasoning_fields=parse_reasoning_fields(body))
    request.images, request.image_params = message_images(body["messages"])
    if request.reasoning_fields.effort is not None:  # for templates that read it (gpt-oss's)
        request.options.template_kwargs.setdefault("reasoning_effort", request.reasoning_fields.effort)
    _validate_sampling(request)
    return request


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, strings, token ids, or lists of token ids."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    def checked_ids(ids: list[int]) -> list[int]:
        for token in ids:
            if not 0 <= token <= MAX_TOKEN_ID:
                raise bad_request(f"'prompt' token ids must be in [0, {MAX_TOKEN_ID}], got {token}", "prompt")
        return list(ids)

    if isinstance(prompt, str):
        return [_utf8(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [_utf8(p, "prompt") for p in prompt]
        if is_ids(prompt):
            return [checked_ids(prompt)]
        if all(is_ids(p) for p in prompt):
            return [checked_ids(p) for p in prompt]
    raise bad_request("'prompt' must be a string, a list of strings, or (lists of) token ids, and not empty",
                      "prompt")


def parse_messages(messages: Any) -> list[dict]:
    """Check chat messages and flatten text content parts to one string per message."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return [_parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _parse_message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{where}.role")
    for key, value in message.items():
        # A null field is an absent one (transformers drops them): a reply's message sent back as it came
        # carries refusal, audio and function_call as null.
        if value is not None and key not in ("role", "content", "name", *MESSAGE_KEYS, *REASONING_KEYS):
            raise bad_request(f"'{where}.{key}' is not supported by pagedserve", f"{where}.{key}")
    text = _message_text(message.get("content"), f"{where}.content", allow_none=role == "assistant")
    entry = {"role": "system" if role == "developer" else role, "content": _utf8(text, f"{where}.content"),
             **parse_message_tool_fields(message, where)}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"'{where}.name' must be a string", f"{where}.name")
        entry["name"] = _utf8(name, f"{where}.name")
    entry.update(history_reasoning(message, where))
    return entry


def _message_text(content: Any, where: str, allow_none: bool) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                parts.append(image_part_text(part, f"{where}[{j}]"))
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{j}]' must be a text or image_url part",
                                  f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'{where}' must be a string or a list of text parts", where)


def _utf8(text: str, param: str) -> str:
    """`text`, refused when it cannot be sent as UTF-8 (JSON allows lone surrogates such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(f"'{param}' is not valid Unicode text (a lone surrogate at position {error.start})",
                          param) from None
    return text


def _typed(body: dict, name: str, kinds: tuple[type, ...]) -> Any:
    """body[name] if present and not null, checked against kinds (a bool is never a number)."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {KIND_WORDS[kinds]}, got {type(value).__name__}", name)
    return value


def refuse_unknown_fields(body: dict, allowed: set[str]) -> None:
    """A field not in `allowed` is refused by name, as OpenAI refuses it."""
    for key in body:
        if key not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key)


def model_field(body: dict) -> str:
    """The body's `model`, a non-empty string."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must provide a model parameter (a string)", "model")
    return model


# SGLang's request fields that vllm-router and SGLang's router write into every request they forward, at
# these values they ask for nothing pagedserve does not already do; any other value is refused by name.
ROUTER_DEFAULTS = {"no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True,
                   "stream_reasoning": True}


def _check_known_fields(body: dict, allowed: set[str]) -> None:
    """Unknown fields are refused by name; known ones pagedserve cannot honour are refused too."""
    for key, default in ROUTER_DEFAULTS.items():
        if key in body and key not in allowed:
            if body[key] != default:
                raise bad_request(f"'{key}' is only accepted as {json.dumps(default)} (pagedserve cannot do "
                                  "otherwise)", key)
            allowed = allowed | {key}
    refuse_unknown_fields(body, allowed)
    _refuse_unsupported(body)


def _refuse_unsupported(body: dict) -> None:
    """Fields OpenAI defines that pagedserve cannot honour are refused, never silently ignored."""
    if body.get("spaces_between_special_tokens") is False:
        raise bad_request("'spaces_between_special_tokens' false is not supported by pagedserve (fast "
                          "tokenizers decode special tokens as they are)", "spaces_between_special_tokens")
    if body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported by pagedserve", "suffix")
    for name in ("functions", "function_call"):
        if body.get(name):
            raise bad_request(f"'{name}' (OpenAI's deprecated function calling) is not supported by pagedserve; "
                              "send 'tools' and 'tool_choice'", name)
    if body.get("store"):
        raise bad_request("'store' is not supported by pagedserve", "store")


def _common(body: dict) -> tuple[str, dict[str, Any], bool, StreamOptions]:
    """Model name, sampling dict, stream and its options, shared by completions and chat."""
    model = model_field(body)
    sampling: dict[str, Any] = {}
    for name, kinds in SAMPLING_FIELDS.items():
        value = _typed(body, name, kinds)
        if value is not None:
            sampling[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop' must be a string or a list of strings", "stop")
        sampling["stop"] = [_utf8(s, "stop") for s in stop]
    sampling.update(_structured_outputs(body))
    stream = _typed(body, "stream", (bool,)) or False
    user = _typed(body, "user", (str,))
    if user is not None:
        logger.debug("request for %s from user %r", model, user)
    return model, sampling, stream, _stream_options(body.get("stream_options"), stream)


def _structured_outputs(body: dict) -> dict[str, Any]:
    """The engine's output constraint from `response_format` (json_object, json_schema) or vLLM's extra
    fields, which the engine checks; two constraints at once are refused."""
    given = {name: body[name] for name in STRUCTURED_FIELDS if body.get(name) is not None}
    if not _constrains_format(body):
        return given
    response_format = body["response_format"]
    if given:
        raise bad_request(f"give 'response_format' or '{next(iter(given))}', not both", "response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return {"structured_outputs": {"json_object": True}}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON Schema object",
                              "response_format")
        return {"structured_outputs": {"json": schema}}
    raise bad_request("'response_format' must have type 'text', 'json_object' or 'json_schema'", "response_format")


def _constrains_format(body: dict) -> bool:
    """Whether `response_format` asks for more than plain text."""
    return body.get("response_format") not in (None, {"type": "text"})


def _structured_renames(body: dict) -> dict[str, str]:
    """A constraint the user gave as response_format is reported as that field."""
    return {"structured_outputs": "response_format"} if _constrains_format(body) else {}


def _stream_options(options: Any, stream: bool) -> StreamOptions:
    """stream_options' include_usage and continuous_usage_stats; only allowed on a streamed request."""
    if options is None:
        return StreamOptions()
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request("'stream_options' must be an object with only 'include_usage' and "
                          "'continuous_usage_stats'", "stream_options")
    include = bool(_typed(options, "include_usage", (bool,)))
    # As vLLM: usage on every chunk only where usage was asked for at all.
    return StreamOptions(include, include and bool(_typed(options, "continuous_usage_stats", (bool,))))


def _add_special_tokens(body: dict, default: bool) -> bool:
    value = _typed(body, "add_special_tokens", (bool,))
    return default if value is None else value


def _validate_sampling(request: GenerationRequest) -> None:
    """Check the sampling dict with the engine's own rules, naming the OpenAI field on failure."""
    try:
        sampling = dict(request.sampling)
        # The request's place in the queue travels with the sampling parameters but is not one of them.
        check_priority(sampling.pop("priority", 0))
        SamplingParams.from_dict(sampling)
    except InvalidRequestError as error:
        raise refusal(str(error), error.field, request.param_renames) from error
