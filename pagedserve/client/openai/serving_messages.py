"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat serving, whole or
streamed as Anthropic's events, errors in Anthropic's shape, the key taken from `x-api-key` as well."""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.client.openai.anthropic_protocol import anthropic_error, chat_body
from pagedserve.client.openai.errors import TRITON_ERRORS, APIError
from pagedserve.client.openai.image_parts import anthropic_image_fields, chat_error, llm_error
from pagedserve.client.openai.serving_chat import ChatGeneration
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.openai.streams import ClientGone, merge_streams, unless_disconnected

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def add_messages_routes(app: FastAPI, shim: OpenAIShim, read_json: Callable[..., Awaitable[dict]]) -> None:
    """POST /v1/messages and /v1/messages/count_tokens."""

    async def messages(request: Request) -> Response:
        try:
            _authorize(request, shim.settings.api_key)
            body = await read_json(request, shim.settings.max_body_bytes)
            generation = await _create(shim, body, chat_body(body))
            run = MessagesRun(generation, body)
            return await (run.stream() if generation.request.stream else run.whole(request))
        except APIError as error:
            return _error_response(error)

    async def count_tokens(request: Request) -> Response:
        try:
            _authorize(request, shim.settings.api_key)
            body = await read_json(request, shim.settings.max_body_bytes)
            generation = await _create(shim, body, chat_body(body, counting=True))
            (prompt,) = generation.request.prompts
            tokens = (await shim.tokenizer()).encode(prompt, add_special_tokens=False).ids
            return JSONResponse({"input_tokens": len(tokens)})
        except APIError as error:
            return _error_response(error)

    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


async def _create(shim: OpenAIShim, body: dict, chat: dict) -> ChatGeneration:
    """The chat generation of a Messages request; an image's fetch refused names its url source."""
    try:
        return await ChatGeneration.create(shim, chat)
    except APIError as error:
        raise chat_error(error, chat["messages"], anthropic_image_fields(body), "source.url") from error


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error(error), status_code=error.status)


def _authorize(request: Request, api_key: str | None) -> None:
    """Anthropic's clients send `x-api-key`; a bearer token is taken too."""
    if api_key is None:
        return
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    given = request.headers.get("x-api-key") or (bearer.strip() if scheme.lower() == "bearer" else "")
    if not hmac.compare_digest(given.encode("utf-8"), api_key.encode("utf-8")):
        raise APIError(401, "invalid x-api-key")


class MessagesRun:
    """One Messages request over its chat generation."""

    def __init__(self, generation: ChatGeneration, body: dict):
        self.generation, self.body = generation, body
        self.id = "msg_" + uuid.uuid4().hex
        self.stops = body.get("stop_sequences") or []
        if self.stops:  # the text keeps the stop sequence that ended it, so the reply can name it
            generation.request.sampling["include_stop_str_in_output"] = True

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
        usage = self.generation.usage()
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body["model"],
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}

    def _llm_error(self, error: Exception) -> APIError:
        """The llm model's error, an image's refusal naming that image block's data."""
        return llm_error(error, self.generation.request.param_renames, anthropic_image_fields(self.body), "messages")

    def _stop(self, finish: str | None, text: str) -> tuple[str | None, str | None]:
        """Anthropic's stop_reason and stop_sequence; a stop sequence is found at the text's end (kept there by
        include_stop_str_in_output and cut by the caller)."""
        if finish == "stop":
            hit = next((s for s in self.stops if text.endswith(s)), None)
            if hit is not None:
                return "stop_sequence", hit
        return _STOP_REASONS.get(finish or "stop", "end_turn"), None

    async def whole(self, request: Request) -> Response:
        merged = merge_streams(self.generation.shim.triton_streams(self.generation.request, self.generation.id))
        try:
            completion = await unless_disconnected(request, self.generation.run(merged))
        except TRITON_ERRORS as error:
            raise self._llm_error(error) from error
        except ClientGone:
            return Response(status_code=499)
        finally:
            await merged.aclose()
        (choice,) = completion["choices"]
        message = choice["message"]
        text = message.get("content") or ""
        reason, sequence = self._stop(choice["finish_reason"], text)
        if sequence is not None:
            text = text[:len(text) - len(sequence)]
        content = []
        if message.get("reasoning") is not None:
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
        if text or not message.get("tool_calls"):
            content.append({"type": "text", "text": text})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        return JSONResponse(self.message(content, reason, sequence))

    async def stream(self) -> Response:
        merged = merge_streams(self.generation.shim.triton_streams(self.generation.request, self.generation.id))
        return StreamingResponse(self._events(merged), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _start(self, input_tokens: int) -> str:
        message = self.message([], None, None)
        message["usage"] = {"input_tokens": input_tokens, "output_tokens": 0}
        return _sse("message_start", {"type": "message_start", "message": message})

    async def _events(self, merged: AsyncIterator[Any]) -> AsyncIterator[str]:
        blocks, tail = BlockWriter(), StopTail(self.stops)
        finish, failed, started = None, None, False
        try:
            async for prompt_index, response in merged:
                if not started:  # sent with the first llm response, which knows the prompt's length
                    started = True
                    yield self._start(response.num_input_tokens or 0)
                for chunk in self.generation._response_chunks(prompt_index, response):
                    for choice in chunk["choices"]:
                        delta = {**choice["delta"], "content": tail.feed(choice["delta"].get("content") or "")}
                        for name, event in blocks.delta(delta):
                            yield _sse(name, event)
                        finish = choice["finish_reason"] or finish
        except TRITON_ERRORS as error:
            failed = self._llm_error(error)
        finally:
            await merged.aclose()
        if not started:
            yield self._start(0)
        if failed is not None:
            yield _sse("error", anthropic_error(failed))
            return
        reason, sequence = self._stop(finish, tail.held)
        rest = tail.held[:len(tail.held) - len(sequence or "")]
        for name, event in [*blocks.delta({"content": rest}), *blocks.close()]:
            yield _sse(name, event)
        usage = self.generation.usage()
        yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"input_tokens": usage["prompt_tokens"],
                                               "output_tokens": usage["completion_tokens"]}})
        yield _sse("message_stop", {"type": "message_stop"})


class StopTail:
    """The last characters of a streamed text held back while they may be a stop sequence."""

    def __init__(self, stops: list[str]):
        self.keep = max(map(len, stops), default=0)
        self.held = ""

    def feed(self, text: str) -> str:
        """What of the text so far may go out now."""
        self.held += text
        cut = max(0, len(self.held) - self.keep)
        out, self.held = self.held[:cut], self.held[cut:]
        return out


class BlockWriter:
    """Chat deltas in, Anthropic content block events out: thinking, text and tool_use blocks in turn."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        self.kind = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def delta(self, delta: dict) -> list[tuple[str, dict]]:
        events = []
        if delta.get("reasoning"):
            if self.kind != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.kind != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id") is not None:
                block = {"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": {}}
                events += self._start("tool_use", block)
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events


def _sse(name: str, event: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
