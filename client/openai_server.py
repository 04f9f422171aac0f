"""OpenAI-compatible HTTP shim (FastAPI) in front of tritonserver's decoupled `llm` model.

`/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE streaming as OpenAI frames it),
`/health`, and `/metrics` passed through from Triton. Requests become `llm` requests over gRPC
streaming; a client that goes away cancels its Triton request, which frees its KV blocks.
Run: `pagedserve openai --triton-url HOST:PORT` or `python -m pagedserve.client.openai_server ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pagedserve.backend.core.errors import INTERNAL_ERROR_PREFIX, InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.client.triton_client import (
    LLMResponse,
    TritonLLMClient,
    TritonRequestError,
    TritonUnavailableError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

DEFAULT_PORT = 9000
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# The key is better read from the environment than from a command line that `ps` shows.
API_KEY_ENV = "PAGEDSERVE_API_KEY"
OPENAI_DEFAULT_COMPLETION_MAX_TOKENS = 16

# Fields taken as they are by both endpoints: OpenAI's sampling knobs plus vLLM's common extras.
_SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "seed": (int,),
    "n": (int,),
    "top_k": (int,),
    "min_p": (int, float),
    "repetition_penalty": (int, float),
    "min_tokens": (int,),
    "ignore_eos": (bool,),
    "stop_token_ids": (list,),
    "skip_special_tokens": (bool,),
    "include_stop_str_in_output": (bool,),
}
_COMMON_FIELDS = {"model", "stream", "stream_options", "stop", "max_tokens", "user", "logit_bias",
                  "add_special_tokens"}
_COMPLETION_FIELDS = _COMMON_FIELDS | set(_SAMPLING_FIELDS) | {"prompt", "echo", "logprobs", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON_FIELDS | set(_SAMPLING_FIELDS) | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "metadata", "store",
}
_CHAT_ROLES = {"system", "developer", "user", "assistant"}


logger = logging.getLogger("pagedserve.openai")


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's JSON shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The JSON body OpenAI sends for this error."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


# Token ids travel to the llm model as INT32.
MAX_TOKEN_ID = 2**31 - 1


def _utf8(text: str, param: str) -> str:
    """`text`, refused when it cannot be sent as UTF-8 (JSON allows lone surrogates such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _bad(f"'{param}' is not valid Unicode text (a lone surrogate at position {error.start})",
                   param) from None
    return text


TRITON_ERRORS = (TritonRequestError, TritonUnavailableError)


def _triton_error(error: Exception) -> APIError:
    """Map a Triton failure: unreachable or a full queue is 503, a server fault 500, anything the model
    refused is a 400."""
    if isinstance(error, TritonUnavailableError):
        return APIError(503, str(error), code="triton_unavailable")
    text = str(error)
    if text.startswith(INTERNAL_ERROR_PREFIX):
        return APIError(500, text, code="internal_error")
    if any(word in text.lower() for word in ("busy", "unavailable", "shutting down")):
        return APIError(503, text, code="server_busy")
    return _bad(text, _param_of_engine_message(text))


# The llm model's refusals start with the engine field they are about (`field: ...` when the message itself
# starts otherwise); OpenAI clients know these names.
_ENGINE_FIELD_TO_PARAM = {"text_input": "prompt", "prompt": "prompt", "prompt_token_ids": "prompt",
                          "input_ids": "prompt", "max_tokens": "max_tokens", "stop": "stop"}


def _param_of_engine_message(message: str) -> str | None:
    """The OpenAI `param` an llm refusal is about, from its leading field name; None when unknown."""
    first = message.split(" ", 1)[0].rstrip(":")
    if first in _ENGINE_FIELD_TO_PARAM:
        return _ENGINE_FIELD_TO_PARAM[first]
    return first if first in _SAMPLING_FIELDS else None


# --------------------------------------------------------------------------- request translation


@dataclass
class GenerationRequest:
    """An OpenAI request translated for the `llm` model: one Triton request per prompt."""

    model: str
    prompts: list[str | list[int]]
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top logprobs per token; None: no logprobs returned
    max_tokens_param: str = "max_tokens"
    messages: list[dict] = field(default_factory=list)
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs), nothing generated
    # Whether the tokenizer adds its special tokens (a BOS) to a text prompt: vLLM's extra field, true for
    # completions, false for chat (the rendered template holds them already).
    add_special_tokens: bool = True

    @property
    def n(self) -> int:
        """Completions per prompt."""
        return int(self.sampling.get("n", 1))


def _typed(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] if present and not null, checked against kinds (a bool is never a number)."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise _bad(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


_KIND_WORDS = {(int, float): "a number", (int,): "an integer", (bool,): "a boolean", (list,): "a list"}


def _check_known_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise _bad(f"Unrecognized request argument supplied: {key}", key)


def _refuse_unsupported(body: dict) -> None:
    """Fields OpenAI defines that pagedserve cannot honour are refused, never silently ignored."""
    if body.get("logit_bias"):
        raise _bad("'logit_bias' is not supported by pagedserve", "logit_bias")
    if body.get("suffix") is not None:
        raise _bad("'suffix' is not supported by pagedserve", "suffix")
    for name in ("tools", "functions", "function_call"):
        if body.get(name):
            raise _bad(f"'{name}' (tool calling) is not supported by pagedserve yet", name)
    if body.get("tool_choice") not in (None, "none"):
        raise _bad("'tool_choice' is not supported by pagedserve yet (only 'none')", "tool_choice")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _bad("'response_format' other than {'type': 'text'} is not supported", "response_format")
    if body.get("store"):
        raise _bad("'store' is not supported by pagedserve", "store")


def _common(body: dict) -> tuple[str, dict[str, Any], bool, bool]:
    """Model name, sampling dict, stream and include_usage, shared by completions and chat."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("you must provide a model parameter (a string)", "model")
    sampling: dict[str, Any] = {}
    for name, kinds in _SAMPLING_FIELDS.items():
        value = _typed(body, name, kinds, _KIND_WORDS[kinds])
        if value is not None:
            sampling[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop' must be a string or a list of strings", "stop")
        sampling["stop"] = [_utf8(s, "stop") for s in stop]
    stream = _typed(body, "stream", (bool,), "a boolean") or False
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad("'stream_options' must be an object with only 'include_usage'", "stream_options")
        include_usage = bool(_typed(options, "include_usage", (bool,), "a boolean"))
    _typed(body, "user", (str,), "a string")
    return model, sampling, stream, include_usage


def _validate_sampling(request: GenerationRequest) -> None:
    """Check the sampling dict with the engine's own rules, naming the OpenAI field on failure."""
    try:
        SamplingParams.from_dict(dict(request.sampling))
    except InvalidRequestError as error:
        renames = {"max_tokens": request.max_tokens_param}
        if request.messages and request.logprobs is not None:
            renames["logprobs"] = "top_logprobs"
        param = renames.get(error.field, error.field)
        message = str(error)
        if error.field and param != error.field and message.startswith(error.field):
            message = param + message[len(error.field):]
        raise _bad(message, param) from error


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, strings, token ids, or lists of token ids."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    def checked_ids(ids: list[int]) -> list[int]:
        for token in ids:
            if not 0 <= token <= MAX_TOKEN_ID:
                raise _bad(f"'prompt' token ids must be in [0, {MAX_TOKEN_ID}], got {token}", "prompt")
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
    raise _bad("'prompt' must be a string, a list of strings, or (lists of) token ids, and not empty", "prompt")


def parse_completion_request(body: dict) -> GenerationRequest:
    """Translate a /v1/completions body; raises APIError(400) naming the bad field."""
    _check_known_fields(body, _COMPLETION_FIELDS)
    _refuse_unsupported(body)
    model, sampling, stream, include_usage = _common(body)
    if "prompt" not in body:
        raise _bad("you must provide a prompt", "prompt")
    prompts = parse_prompts(body["prompt"])
    max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    echo = bool(_typed(body, "echo", (bool,), "a boolean"))
    echo_only = echo and max_tokens == 0
    if echo_only:  # as vLLM: the engine makes one token, which is not returned
        max_tokens = 1
    sampling["max_tokens"] = OPENAI_DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    logprobs = _typed(body, "logprobs", (int,), "an integer")
    if logprobs is not None:
        sampling["logprobs"] = logprobs
        if echo:  # the echoed prompt's tokens get logprobs too (what lm-evaluation-harness scores with)
            sampling["prompt_logprobs"] = logprobs
    best_of = _typed(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != sampling.get("n", 1):
        raise _bad("'best_of' different from 'n' is not supported", "best_of")
    request = GenerationRequest(model, prompts, sampling, stream, include_usage, echo, logprobs, echo_only=echo_only,
                                add_special_tokens=_add_special_tokens(body, default=True))
    _validate_sampling(request)
    return request


def parse_chat_request(body: dict) -> GenerationRequest:
    """Translate a /v1/chat/completions body (messages kept for the chat template)."""
    _check_known_fields(body, _CHAT_FIELDS)
    _refuse_unsupported(body)
    model, sampling, stream, include_usage = _common(body)
    messages = parse_messages(body.get("messages"))
    max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    max_completion_tokens = _typed(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise _bad("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
    # OpenAI's chat default is "until the context is full": None means up to max_model_len.
    sampling["max_tokens"] = limit
    logprobs = None
    top_logprobs = _typed(body, "top_logprobs", (int,), "an integer")
    if _typed(body, "logprobs", (bool,), "a boolean"):
        logprobs = top_logprobs or 0
        sampling["logprobs"] = logprobs
    elif top_logprobs is not None:
        raise _bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    request = GenerationRequest(
        model, [], sampling, stream, include_usage, False, logprobs,
        "max_completion_tokens" if max_completion_tokens is not None else "max_tokens", messages,
        add_special_tokens=_add_special_tokens(body, default=False),
    )
    _validate_sampling(request)
    return request


def _add_special_tokens(body: dict, default: bool) -> bool:
    value = _typed(body, "add_special_tokens", (bool,), "a boolean")
    return default if value is None else value


def parse_messages(messages: Any) -> list[dict]:
    """Check chat messages and flatten text content parts to one string per message."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise _bad(f"'{where}.role' must be one of {sorted(_CHAT_ROLES)}, got {role!r}", f"{where}.role")
        for key in message:
            if key not in ("role", "content", "name"):
                raise _bad(f"'{where}.{key}' is not supported by pagedserve", f"{where}.{key}")
        text = _utf8(_message_text(message.get("content"), f"{where}.content", allow_none=role == "assistant"),
                     f"{where}.content")
        entry = {"role": "system" if role == "developer" else role, "content": text}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad(f"'{where}.name' must be a string", f"{where}.name")
            entry["name"] = _utf8(name, f"{where}.name")
        out.append(entry)
    return out


def _message_text(content: Any, where: str, allow_none: bool) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"'{where}[{j}]' must be a text part (only text content is supported)", f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"'{where}' must be a string or a list of text parts", where)


# --------------------------------------------------------------------------- chat template


class ChatTemplate:
    """The model folder's chat template, rendered in jinja2's immutable sandbox as transformers does."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """Read `chat_template.jinja`, `chat_template.json` or tokenizer_config.json's `chat_template`."""
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if (folder / "chat_template.json").exists():
            source = json.loads((folder / "chat_template.json").read_text()).get("chat_template", source)
        if (folder / "chat_template.jinja").exists():
            source = (folder / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source:
            raise FileNotFoundError(f"no chat template in {folder}")
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for these messages; a template error is the caller's 400 on `messages`."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as error:
            raise _bad(f"chat template failed for these messages: {error}", "messages") from error


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _token_text(token: Any) -> str:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


# --------------------------------------------------------------------------- response shapes


def sse_event(payload: dict | str) -> str:
    """One server-sent event as OpenAI frames it: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse_event("[DONE]")


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(entries: list[dict], top: int, text_offset: int) -> dict:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry["token"])
        token_logprobs.append(entry["logprob"])
        offsets.append(text_offset)
        text_offset += len(entry["token"])
        if top > 0 and entry["logprob"] is not None:  # an echoed prompt's first token has none
            ranked: dict[str, float] = {}
            for candidate in entry.get("top_logprobs", [])[:top]:
                # Tokens that decode alike (partial UTF-8 shows as U+FFFD) keep the best logprob.
                ranked.setdefault(candidate["token"], candidate["logprob"])
            tops.append(ranked)
        else:
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[dict], top: int) -> dict:
    """Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`."""

    def one(entry: dict) -> dict:
        return {"token": entry["token"], "logprob": entry["logprob"], "bytes": list(entry["token"].encode("utf-8"))}

    content = [
        {**one(entry), "top_logprobs": [one(t) for t in entry.get("top_logprobs", [])[:top]]} for entry in entries
    ]
    return {"content": content, "refusal": None}


@dataclass
class ChoiceState:
    """What one choice has produced so far (the whole text is kept only for non-streamed answers)."""

    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    text_offset: int = 0


# --------------------------------------------------------------------------- the server


@dataclass
class ShimSettings:
    """What the shim needs to know; `model_path` is asked of Triton when not given."""

    triton_url: str = "localhost:8001"
    model_name: str | None = None
    model_path: str | None = None
    api_key: str | None = None
    metrics_url: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class OpenAIShim:
    """The request handlers, holding the Triton client and the lazily loaded chat template."""

    def __init__(self, settings: ShimSettings):
        self.settings = settings
        self.model_name = settings.model_name or (Path(settings.model_path).name if settings.model_path else "llm")
        self.metrics_url = settings.metrics_url or f"http://{settings.triton_url.rsplit(':', 1)[0]}:8002/metrics"
        self.created = int(time.time())
        self._client: TritonLLMClient | None = None
        self._chat_template: ChatTemplate | None = None
        self._tokenizer: Any = None

    @property
    def client(self) -> TritonLLMClient:
        """The gRPC client of the `llm` model."""
        # Made on first use so the gRPC channel binds to the running event loop.
        if self._client is None:
            self._client = TritonLLMClient(self.settings.triton_url)
        return self._client

    async def close(self) -> None:
        """Close the gRPC channel, if one was opened."""
        if self._client is not None:
            await self._client.close()

    async def model_dir(self) -> Path:
        """The model folder: --model, else the `model_path` parameter of the llm model's config."""
        if self.settings.model_path is None:
            try:
                params = await self.client.model_parameters()
            except TritonUnavailableError as error:
                raise APIError(503, f"cannot ask Triton for the model folder: {error}") from error
            path = params.get("model_path") or params.get("model")
            if not path:
                raise APIError(500, "the llm model's config has no model_path parameter; start the shim with --model")
            self.settings.model_path = path
        return Path(self.settings.model_path)

    async def chat_template(self) -> ChatTemplate:
        """The model folder's chat template, read once."""
        if self._chat_template is None:
            folder = await self.model_dir()
            try:
                self._chat_template = ChatTemplate.from_model_dir(folder)
            except FileNotFoundError as error:
                raise _bad(f"the model has no chat template ({error}); use /v1/completions", "messages") from error
        return self._chat_template

    async def decode(self, token_ids: list[int]) -> str:
        """Prompt text of token ids (for echo), with the model folder's tokenizer.json."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(await self.model_dir() / "tokenizer.json"))
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def check_model(self, name: str) -> None:
        """404 model_not_found unless `name` is the served model id."""
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def model_card(self) -> dict:
        """The served model as /v1/models lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve"}

    def triton_streams(self, request: GenerationRequest, request_id: str) -> list[AsyncIterator[LLMResponse]]:
        """One `llm` request per prompt."""
        streams = []
        for i, prompt in enumerate(request.prompts):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            streams.append(
                self.client.generate(
                    text,
                    input_ids=ids,
                    sampling_parameters=request.sampling,
                    stream=request.stream,
                    return_logprobs=request.logprobs is not None,
                    request_id=f"{request_id}-{i}",
                    add_special_tokens=request.add_special_tokens,
                )
            )
        return streams


async def merge_streams(streams: list[AsyncIterator[LLMResponse]]) -> AsyncIterator[tuple[int, LLMResponse]]:
    """Interleave several response streams as items arrive; closing the merge cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[LLMResponse]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as error:
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Generation:
    """Runs one translated request and turns `llm` responses into OpenAI's bodies and chunks."""

    def __init__(self, shim: OpenAIShim, request: GenerationRequest, chat: bool):
        self.shim, self.request, self.chat = shim, request, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(len(request.prompts) * request.n)]
        self.prompt_tokens = [0] * len(request.prompts)
        # Echo with logprobs: each prompt's token entries, from its first response.
        self.prompt_entries: list[list[dict]] = [[] for _ in request.prompts]

    async def prompt_texts(self) -> list[str]:
        """Each prompt as text (token-id prompts decoded), for echo."""
        return [p if isinstance(p, str) else await self.shim.decode(p) for p in self.request.prompts]

    def _absorb(self, prompt_index: int, response: LLMResponse) -> list[tuple[int, str, list[dict], str | None]]:
        """Record one response; returns (choice index, new text, new logprob entries, finish reason if it
        ended now) per sequence."""
        if response.num_input_tokens is not None:
            self.prompt_tokens[prompt_index] = response.num_input_tokens
        if response.prompt_logprobs is not None:
            self.prompt_entries[prompt_index] = response.prompt_logprobs
        updates = []
        for i, text in enumerate(response.text):
            index = prompt_index * self.request.n + i
            state = self.choices[index]
            if state.finish_reason is not None:
                continue  # the llm model repeats an ended completion's finish reason in later responses
            entries = response.logprobs[i] if response.logprobs is not None else []
            finish = response.finish_reason[i]
            if self.request.echo_only:
                text, entries, finish = "", [], finish and "length"
            if not self.request.stream:
                state.text += text
                state.logprobs.extend(entries)
            if response.num_output_tokens is not None and not self.request.echo_only:
                state.num_output_tokens = response.num_output_tokens[i]
            if finish is not None:
                state.finish_reason = finish
            updates.append((index, text, entries, finish))
        return updates

    def usage(self) -> dict:
        """Usage summed over every prompt and choice so far."""
        return usage_body(sum(self.prompt_tokens), sum(c.num_output_tokens for c in self.choices))

    def _logprobs(self, entries: list[dict], state: ChoiceState) -> dict | None:
        if self.request.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.request.logprobs)
        body = completion_logprobs(entries, self.request.logprobs, state.text_offset)
        state.text_offset += sum(len(e["token"]) for e in entries)
        return body

    async def run(self, stream: AsyncIterator[tuple[int, LLMResponse]]) -> dict:
        """Collect a whole non-streamed answer."""
        echoes = await self.prompt_texts() if self.request.echo else None
        async for prompt_index, response in stream:
            self._absorb(prompt_index, response)
        choices = []
        for index, state in enumerate(self.choices):
            if self.chat:
                message = {"role": "assistant", "content": state.text, "refusal": None}
                choice = {"index": index, "message": message}
            else:
                prefix = echoes[index // self.request.n] if echoes else ""
                choice = {"index": index, "text": prefix + state.text}
            entries = state.logprobs
            if echoes:
                entries = self.prompt_entries[index // self.request.n] + entries
            choice["logprobs"] = self._logprobs(entries, state)
            choice["finish_reason"] = state.finish_reason
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }

    def _chunk(self, index: int, text: str | None, logprobs: dict | None, finish: str | None,
               role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.request.model,
            "choices": [choice],
            "system_fingerprint": None,
        }
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _echo_chunks(self, prompt_index: int, prompt: str, entries: list[dict]) -> list[str]:
        """The echoed prompt as the first chunk of each of its choices, with its token logprobs if asked."""
        events = []
        for index in range(prompt_index * self.request.n, (prompt_index + 1) * self.request.n):
            logprobs = self._logprobs(entries, self.choices[index])
            events.append(sse_event(self._chunk(index, prompt, logprobs, None)))
        return events

    async def chunks(self, stream: AsyncIterator[tuple[int, LLMResponse]]) -> AsyncIterator[str]:
        """The SSE events of a streamed answer, ending with the usage chunk (if asked) and [DONE]."""
        if self.chat:
            for index in range(len(self.choices)):
                yield sse_event(self._chunk(index, None, None, None, role=True))
        # Echoed prompts still to send, by prompt index: with logprobs, each waits for its first response,
        # which brings the prompt's logprobs.
        echoes: dict[int, str] = {}
        if self.request.echo:
            echoes = dict(enumerate(await self.prompt_texts()))
            if self.request.logprobs is None:
                for prompt_index, prompt in echoes.items():
                    for event in self._echo_chunks(prompt_index, prompt, []):
                        yield event
                echoes = {}
        try:
            async for prompt_index, response in stream:
                if prompt_index in echoes and response.prompt_logprobs is not None:
                    for event in self._echo_chunks(prompt_index, echoes.pop(prompt_index), response.prompt_logprobs):
                        yield event
                for index, text, entries, finish in self._absorb(prompt_index, response):
                    state = self.choices[index]
                    if not text and not entries and finish is None:
                        continue
                    logprobs = self._logprobs(entries, state)
                    if self.chat and finish is not None and text:
                        yield sse_event(self._chunk(index, text, logprobs, None))
                        text, logprobs = None, None
                    yield sse_event(self._chunk(index, text, logprobs, finish))
        except TRITON_ERRORS as error:
            yield sse_event(_triton_error(error).body())
            yield SSE_DONE
            return
        if self.request.include_usage:
            usage_chunk = self._chunk(0, None, None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = self.usage()
            yield sse_event(usage_chunk)
        yield SSE_DONE


async def _read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object, refusing bodies over `limit` bytes (413) before parsing."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _bad(f"request body is not valid JSON: {error}", None) from error
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    return body


async def _until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work` but cancel it (and so its Triton requests) if the HTTP client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


def create_app(settings: ShimSettings) -> FastAPI:
    """The FastAPI application of the shim."""
    shim = OpenAIShim(settings)

    async def lifespan(app: FastAPI):
        yield
        await shim.close()

    app = FastAPI(title="pagedserve OpenAI-compatible API", lifespan=lifespan)
    app.state.shim = shim

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods answer in OpenAI's shape too, not FastAPI's {"detail": ...}.
        if error.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = f"{error.detail} ({request.method} {request.url.path})"
        body = APIError(error.status_code, message, code="not_found" if error.status_code == 404 else None)
        return JSONResponse(body.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        # A bug of ours still answers in OpenAI's shape; the traceback goes to the log.
        logger.exception("unexpected error serving %s", request.url.path)
        body = APIError(500, f"internal error in the OpenAI shim: {type(error).__name__}", code="internal_error")
        return JSONResponse(body.body(), status_code=500)

    async def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        expected = settings.api_key.encode("utf-8")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), expected):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        ready = await shim.client.ready()
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as http:
                upstream = await http.get(shim.metrics_url)
        except httpx.HTTPError as error:
            raise APIError(503, f"cannot reach Triton metrics at {shim.metrics_url}: {error}") from error
        return Response(upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "text/plain"))

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> dict:
        return {"object": "list", "data": [shim.model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def get_model(model_id: str) -> dict:
        shim.check_model(model_id)
        return shim.model_card()

    async def generate(request: Request, chat: bool) -> Response:
        body = await _read_json(request, settings.max_body_bytes)
        parsed = parse_chat_request(body) if chat else parse_completion_request(body)
        shim.check_model(parsed.model)
        if chat:
            parsed.prompts = [(await shim.chat_template()).render(parsed.messages)]
        generation = Generation(shim, parsed, chat)
        merged = merge_streams(shim.triton_streams(parsed, generation.id))
        if parsed.stream:
            return await _stream_response(request, generation, merged)
        try:
            return JSONResponse(await _unless_disconnected(request, generation.run(merged)))
        except TRITON_ERRORS as error:
            raise _triton_error(error) from error
        except ClientGone:
            return Response(status_code=499)
        finally:
            await merged.aclose()

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


async def _stream_response(request: Request, generation: Generation,
                           merged: AsyncIterator[tuple[int, LLMResponse]]) -> Response:
    """Wait for the first Triton response (so early errors get a real status), then stream SSE."""
    try:
        first = await _unless_disconnected(request, merged.__anext__())
    except StopAsyncIteration:
        first = None
    except TRITON_ERRORS as error:
        await merged.aclose()
        raise _triton_error(error) from error
    except ClientGone:
        await merged.aclose()
        return Response(status_code=499)

    async def replay() -> AsyncIterator[tuple[int, LLMResponse]]:
        if first is not None:
            yield first
            async for item in merged:
                yield item

    async def body() -> AsyncIterator[str]:
        try:
            async for event in generation.chunks(replay()):
                yield event
        finally:
            await merged.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedserve openai` and `python -m pagedserve.client.openai_server`."""
    parser.add_argument("--triton-url", default="localhost:8001", help="tritonserver gRPC address HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})")
    parser.add_argument("--model-name", default=None, help="model id served on /v1/models")
    parser.add_argument("--model", default=None, help="model folder (chat template); default: ask Triton")
    parser.add_argument("--metrics-url", default=None, help="Triton metrics URL (default: HOST:8002/metrics)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Serve the shim until interrupted."""
    import uvicorn

    settings = ShimSettings(
        triton_url=args.triton_url,
        model_name=args.model_name,
        model_path=args.model,
        api_key=args.api_key,
        metrics_url=args.metrics_url,
        max_body_bytes=args.max_body_bytes,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m pagedserve.client.openai_server`."""
    parser = argparse.ArgumentParser(prog="pagedserve-openai", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
