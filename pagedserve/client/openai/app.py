"""The FastAPI application: routes only; each generation endpoint is a `Generation` subclass.

`/v1/models`, `/v1/completions`, `/v1/chat/completions` (SSE streaming as OpenAI frames it), `/v1/responses`
(serving_responses), Anthropic's `/v1/messages` (serving_messages, errors in Anthropic's shape), vLLM's
`/tokenize`, `/detokenize`, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, `/health`, and `/metrics` passed through from Triton; every error answers in OpenAI's JSON shape.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.client.openai.errors import TRITON_ERRORS, APIError, bad_request, triton_api_error
from pagedserve.client.openai.generation import Generation
from pagedserve.client.openai.lora import load_lora_adapter, unload_lora_adapter
from pagedserve.client.openai.serving_chat import ChatGeneration
from pagedserve.client.openai.serving_completion import CompletionGeneration
from pagedserve.client.openai.serving_messages import add_messages_routes
from pagedserve.client.openai.serving_pooling import add_pooling_routes, model_tasks
from pagedserve.client.openai.serving_responses import add_responses_routes
from pagedserve.client.openai.serving_tokens import detokenize, tokenize
from pagedserve.client.openai.shim import OpenAIShim, ShimSettings
from pagedserve.client.openai.streams import ClientGone, merge_streams, unless_disconnected
from pagedserve.client.triton_client import LLMResponse

logger = logging.getLogger("pagedserve.openai")

ENDPOINTS: dict[str, type[Generation]] = {
    "/v1/completions": CompletionGeneration,
    "/v1/chat/completions": ChatGeneration,
}
# What nginx logs when the client closed the connection before the answer: nobody reads this status.
CLIENT_CLOSED_REQUEST = 499


def create_app(settings: ShimSettings) -> FastAPI:
    """The FastAPI application of the shim."""
    shim = OpenAIShim(settings)

    async def lifespan(app: FastAPI):
        yield
        await shim.close()

    app = FastAPI(title="pagedserve OpenAI-compatible API", lifespan=lifespan)
    app.state.shim = shim
    _add_error_handlers(app)
    _add_service_routes(app, shim)
    authorized = [Depends(_authorizer(settings.api_key))]

    @app.get("/v1/models", dependencies=authorized)
    async def list_models() -> dict:
        cards = await shim.model_cards()
        tasks = await model_tasks(shim)  # what the model does: generate, embed, classify / score
        return {"object": "list", "data": [{**card, "capabilities": tasks} for card in cards]}

    @app.get("/v1/models/{model_id:path}", dependencies=authorized)
    async def get_model(model_id: str) -> dict:
        adapter = await shim.resolve_model(model_id)
        if adapter is None:
            return next(card for card in await shim.model_cards() if card["id"] == model_id)
        return shim.adapters.card(model_id, adapter, shim.model_name, shim.created, await shim.max_model_len())

    for path, handler in (("/tokenize", tokenize), ("/detokenize", detokenize)):
        app.add_api_route(path, _json_route(shim, handler), methods=["POST"], dependencies=authorized,
                          name=handler.__name__)
    for path, handler in (("/v1/load_lora_adapter", load_lora_adapter),
                          ("/v1/unload_lora_adapter", unload_lora_adapter)):
        app.add_api_route(path, _text_route(shim, handler), methods=["POST"], dependencies=authorized,
                          name=handler.__name__)

    for path, endpoint in ENDPOINTS.items():
        app.add_api_route(path, _generation_route(shim, endpoint), methods=["POST"], dependencies=authorized,
                          name=endpoint.__name__)
    add_responses_routes(app, shim, authorized, _read_json)
    add_messages_routes(app, shim, _read_json)
    add_pooling_routes(app, shim, authorized, _read_json)
    return app


def _add_error_handlers(app: FastAPI) -> None:
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


def _add_service_routes(app: FastAPI, shim: OpenAIShim) -> None:
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


def _authorizer(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The /v1 dependency that checks the bearer key (in constant time), when one is configured."""

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        expected = api_key.encode("utf-8")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), expected):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                           code="invalid_api_key")

    return authorize


def _json_route(shim: OpenAIShim, handler: Callable[[OpenAIShim, dict], Awaitable[dict]]
                ) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return JSONResponse(await handler(shim, await _read_json(request, shim.settings.max_body_bytes)))

    return route


def _text_route(shim: OpenAIShim, handler: Callable[[OpenAIShim, dict], Awaitable[str]]
                ) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return PlainTextResponse(await handler(shim, await _read_json(request, shim.settings.max_body_bytes)))

    return route


def _generation_route(shim: OpenAIShim, endpoint: type[Generation]) -> Callable[[Request], Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        body = await _read_json(request, shim.settings.max_body_bytes)
        return await _answer(request, await endpoint.create(shim, body))

    return generate


async def _answer(request: Request, generation: Generation) -> Response:
    """Send the llm requests and answer with the whole body or a stream; a client gone cancels them."""
    merged = merge_streams(generation.shim.triton_streams(generation.request, generation.id))
    if generation.request.stream:
        return await _stream_response(request, generation, merged)
    try:
        return JSONResponse(await unless_disconnected(request, generation.run(merged)))
    except TRITON_ERRORS as error:
        raise triton_api_error(error, generation.request.param_renames) from error
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await merged.aclose()


async def _stream_response(request: Request, generation: Generation,
                           merged: AsyncIterator[tuple[int, LLMResponse]]) -> Response:
    """Wait for the first Triton response (so early errors get a real status), then stream SSE."""
    try:
        first = await unless_disconnected(request, merged.__anext__())
    except StopAsyncIteration:
        first = None
    except TRITON_ERRORS as error:
        await merged.aclose()
        raise triton_api_error(error, generation.request.param_renames) from error
    except ClientGone:
        await merged.aclose()
        return Response(status_code=CLIENT_CLOSED_REQUEST)

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


async def _read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object, refusing bodies over `limit` bytes (413) before parsing."""
    too_large = APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"request body is not valid JSON: {error}", None) from error
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", None)
    return body
