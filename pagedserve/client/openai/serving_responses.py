"""/v1/responses: OpenAI's Responses API over the chat serving (create whole or streamed as the SDK's events,
GET, DELETE and cancel of stored responses, conversations continued by previous_response_id)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.client.openai.errors import TRITON_ERRORS, APIError, bad_request
from pagedserve.client.openai.image_parts import chat_error, llm_error, responses_image_fields
from pagedserve.client.openai.responses_input import ResponsesInput, read_responses_request
from pagedserve.client.openai.responses_output import EventWriter, history_messages, new_id, output_items
from pagedserve.client.openai.responses_store import ResponseStore, StoredResponse
from pagedserve.client.openai.serving_chat import ChatGeneration
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.openai.streams import ClientGone, merge_streams, unless_disconnected

# The chat fields a Responses request sent under its own names, for refusals' `param`.
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input", "reasoning_effort": "reasoning.effort"}
CLIENT_CLOSED_REQUEST = 499


def add_responses_routes(app: FastAPI, shim: OpenAIShim, dependencies: list, read_json: Callable[..., Awaitable[dict]]
                         ) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel."""
    settings = shim.settings
    store = ResponseStore(settings.responses_store_size, settings.responses_store_max_age_s)

    async def create(request: Request) -> Response:
        return await ResponseRun.start(shim, store, request, await read_json(request, settings.max_body_bytes))

    async def get(response_id: str) -> dict:
        return store.get(response_id).body

    async def delete(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(response_id: str) -> dict:
        entry = store.get(response_id)
        if entry.body["status"] != "in_progress":
            raise bad_request(f"Cannot cancel response '{response_id}': it is {entry.body['status']}", None)
        entry.cancelled = True
        return {**entry.body, "status": "cancelled"}

    app.add_api_route("/v1/responses", create, methods=["POST"], dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}", get, methods=["GET"], dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"], dependencies=dependencies)
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"], dependencies=dependencies)


def _renamed(error: APIError) -> APIError:
    """A chat refusal named as the Responses request names the field."""
    param = error.param
    if param is not None:
        head = param.split("[", 1)[0].split(".", 1)[0]
        param = "input" if head == "messages" else _PARAMS.get(param, param)
    return APIError(error.status, error.message, param, error.code)


class ResponseRun:
    """One Responses request: its chat generation, its response object, and its entry in the store."""

    def __init__(self, store: ResponseStore, read: ResponsesInput, body: dict, generation: ChatGeneration):
        self.store, self.read, self.generation = store, read, generation
        self.id, self.created_at = new_id("resp"), time.time()
        self.request_body = body
        self.entry: StoredResponse | None = None
        self.image_fields: list[str] = []  # the field of each image the llm model gets, for its refusals

    @classmethod
    async def start(cls, shim: OpenAIShim, store: ResponseStore, request: Request, body: dict) -> Response:
        previous_id = body.get("previous_response_id")
        previous: list[dict] = []
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise bad_request("'previous_response_id' must be a string", "previous_response_id")
            previous = store.get(previous_id, "previous_response_id").history
        read = read_responses_request(body, previous)
        image_fields = responses_image_fields(body, previous)
        try:
            generation = await ChatGeneration.create(shim, {**read.chat_body, "stream": read.stream})
        except APIError as error:  # an image's fetch refused names its input_image part
            raise _renamed(chat_error(error, read.chat_body["messages"], image_fields, "image_url")) from error
        run = cls(store, read, body, generation)
        run.image_fields = image_fields
        if read.store:
            run.entry = store.put(run.body("in_progress", []), read.history)
        if read.stream:
            return await run.stream(request)
        return await run.whole(request)

    def body(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        """The response object now."""
        request = self.request_body
        fmt = (request.get("text") or {}).get("format") or {"type": "text"}
        usage = None if status == "in_progress" else self._usage()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": request["model"], "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
            "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
            "text": {"format": fmt}, "store": self.read.store, "usage": usage, "truncation": "disabled",
            **{key: value for key, value in self.read.echo.items()},
        }

    def _usage(self) -> dict:
        usage = self.generation.usage()
        details = usage.get("completion_tokens_details") or {}
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
                "total_tokens": usage["total_tokens"]}

    def _finish(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        body = self.body(status, output, error)
        if self.entry is not None:
            if self.entry.cancelled:
                body["status"] = "cancelled"
            self.store.put(body, [*self.read.history, *history_messages(output)])
        return body

    async def whole(self, request: Request) -> Response:
        merged = merge_streams(self.generation.shim.triton_streams(self.generation.request, self.generation.id))
        try:
            completion = await unless_disconnected(request, self.generation.run(merged))
        except TRITON_ERRORS as error:
            self._drop()
            raise self._llm_error(error) from error
        except ClientGone:
            self._drop()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            await merged.aclose()
        (choice,) = completion["choices"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return JSONResponse(self._finish(status, output_items(choice["message"])))

    def _llm_error(self, error: Exception) -> APIError:
        """The llm model's error named as this request names the field (an image by its input_image part)."""
        return _renamed(llm_error(error, self.generation.request.param_renames, self.image_fields, "input"))

    def _drop(self) -> None:
        """A response that failed before its answer is not kept."""
        if self.entry is not None:
            self.store.discard(self.id)

    async def stream(self, request: Request) -> Response:
        merged = merge_streams(self.generation.shim.triton_streams(self.generation.request, self.generation.id))
        return StreamingResponse(self._events(merged), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, merged: AsyncIterator[Any]) -> AsyncIterator[str]:
        writer, finish, error = EventWriter(), None, None
        yield _sse(writer.event("response.created", response=self.body("in_progress", [])))
        yield _sse(writer.event("response.in_progress", response=self.body("in_progress", [])))
        try:
            async for prompt_index, response in merged:
                for chunk in self.generation._response_chunks(prompt_index, response):
                    for choice in chunk["choices"]:
                        for event in writer.delta(choice["delta"]):
                            yield _sse(event)
                        finish = choice["finish_reason"] or finish
                if self.entry is not None and self.entry.cancelled:
                    break
        except TRITON_ERRORS as failure:
            error = self._llm_error(failure).body()["error"]
        finally:
            await merged.aclose()
        for event in writer.close():
            yield _sse(event)
        status = "failed" if error else "incomplete" if finish == "length" else "completed"
        body = self._finish(status, writer.items, error)
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(body["status"],
                                                                                      "response.completed")
        yield _sse(writer.event(kind, response=body))


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
