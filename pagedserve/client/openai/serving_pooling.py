"""Pooling endpoints: OpenAI's `/v1/embeddings`, vLLM's `/pooling`, `/classify`, `/score`, `/rerank` (also
`/v1/rerank`, `/v2/rerank`: Jina's and Cohere's shape). Every input is one `embedding_request` to the `llm`
model, sent together and joined in input order; bad input is refused naming the field."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import struct
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedserve.backend.core.config import ModelConfig
from pagedserve.client.openai.errors import TRITON_ERRORS, APIError, bad_request, triton_api_error
from pagedserve.client.openai.protocol import MAX_TOKEN_ID, model_field, refuse_unknown_fields
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.triton_client import TritonUnavailableError

# The engine's default for the most inputs (texts, token lists, documents, pairs) one request may carry.
MAX_POOLING_INPUTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}["max_pooling_inputs"]
_INPUT_LIMITS: weakref.WeakKeyDictionary[OpenAIShim, int] = weakref.WeakKeyDictionary()
# Engine fields as the endpoints name them.
_RENAMES = {"embedding_request.input": "input", "prompt_token_ids": "input", "prompt": "input", "text": "input",
            "text_pair": "input", "input": "input", "task": "model", "dimensions": "dimensions",
            "embedding_request.pooling_params.dimensions": "dimensions"}
_ENCODER_ARCHS = ("BertModel", "XLMRobertaModel", "ModernBertModel")


async def model_tasks(shim: OpenAIShim) -> list[str]:
    """What the served model does, as its folder says (the engine's `runner` auto rule): generate, embed, or
    classify and score."""
    try:
        params = await shim.client.model_parameters()
        folder = await shim.model_dir()
    except (TritonUnavailableError, APIError):
        return []  # not known while Triton cannot be asked; the model list still answers
    config_file = folder / "config.json"
    archs = json.loads(config_file.read_text()).get("architectures") or [] if config_file.is_file() else []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return ["classify", "score"]
    runner = params.get("runner") or "auto"
    pooling = runner == "pooling" or (runner == "auto" and (any(a in _ENCODER_ARCHS for a in archs)
                                                           or (folder / "modules.json").is_file()))
    return ["embed"] if pooling else ["generate", "embed"] if runner == "all" else ["generate"]


async def max_pooling_inputs(shim: OpenAIShim) -> int:
    """The llm model's max_pooling_inputs parameter, read once (the default while unset or Triton cannot be
    asked)."""
    if shim not in _INPUT_LIMITS:
        try:
            value = (await shim.client.model_parameters()).get("max_pooling_inputs", "").strip()
        except TritonUnavailableError:
            return MAX_POOLING_INPUTS
        _INPUT_LIMITS[shim] = int(value) if value.isdigit() else MAX_POOLING_INPUTS
    return _INPUT_LIMITS[shim]


def _inputs(body: dict, limit: int, name: str = "input") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists, as a list of at most
    `limit` inputs."""
    value = body.get(name)
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{name}' must be a non-empty string, list of strings or list of token ids", name)
    if len(value) > limit:
        raise bad_request(f"'{name}' holds {len(value)} inputs; at most {limit} a request (max_pooling_inputs)",
                          name)
    for item in value:
        text = isinstance(item, str) and item
        ids = isinstance(item, list) and item and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in item)
        if not (text or ids):
            raise bad_request(f"each '{name}' entry must be a non-empty string or a non-empty list of token ids", name)
    return value


async def _pool_all(shim: OpenAIShim, requests: list[dict]) -> tuple[list[list[float]], int]:
    """Send every embedding_request at once; (vectors in order, total input tokens)."""
    rid = uuid.uuid4().hex
    try:
        answers = await asyncio.gather(*(shim.client.pool(r, f"{rid}-{i}") for i, r in enumerate(requests)))
    except TRITON_ERRORS as error:
        raise triton_api_error(error, _RENAMES) from error
    return [vector for vector, _ in answers], sum(count for _, count in answers)


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _header(shim: OpenAIShim, prefix: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": shim.model_name}


async def embeddings(shim: OpenAIShim, body: dict) -> dict:
    """OpenAI's /v1/embeddings: `input`, `encoding_format` float or base64, `dimensions`, usage."""
    refuse_unknown_fields(body, {"model", "input", "encoding_format", "dimensions", "user", "normalize"})
    await shim.resolve_model(model_field(body))
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    params: dict[str, Any] = {"task": "embed"}
    dims = body.get("dimensions")
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise bad_request("'dimensions' must be an integer >= 1", "dimensions")
        params["dimensions"] = dims
    if body.get("normalize") is not None:
        params["normalize"] = body["normalize"]
    inputs = _inputs(body, await max_pooling_inputs(shim))
    vectors, tokens = await _pool_all(shim, [{"input": x, "pooling_params": params} for x in inputs])
    data = [{"object": "embedding", "index": i,
             "embedding": _base64(v) if fmt == "base64" else v} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": shim.model_name, "usage": _usage(tokens)}


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 embedding: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def pooling(shim: OpenAIShim, body: dict) -> dict:
    """vLLM's /pooling: the model's pooled output of each input (its embedding, or its class probabilities)."""
    refuse_unknown_fields(body, {"model", "input", "encoding_format", "dimensions", "user", "normalize"})
    task = "embed" if "embed" in await model_tasks(shim) else "classify"
    await shim.resolve_model(model_field(body))
    inputs = _inputs(body, await max_pooling_inputs(shim))
    vectors, tokens = await _pool_all(shim, [{"input": x, "pooling_params": {"task": task}} for x in inputs])
    data = [{"object": "pooling", "index": i, "data": v} for i, v in enumerate(vectors)]
    return {**_header(shim, "pool"), "data": data, "usage": _usage(tokens)}


async def classify(shim: OpenAIShim, body: dict) -> dict:
    """vLLM's /classify: each input's label and class probabilities (id2label from the model's config)."""
    refuse_unknown_fields(body, {"model", "input", "user"})
    await shim.resolve_model(model_field(body))
    inputs = _inputs(body, await max_pooling_inputs(shim))
    vectors, tokens = await _pool_all(shim, [{"input": x, "pooling_params": {"task": "classify"}} for x in inputs])
    labels = await _labels(shim)
    data = [{"index": i, "label": labels.get(max(range(len(v)), key=v.__getitem__)), "probs": v,
             "num_classes": len(v)} for i, v in enumerate(vectors)]
    return {**_header(shim, "classify"), "data": data, "usage": _usage(tokens)}


async def _labels(shim: OpenAIShim) -> dict[int, str]:
    config_file = await shim.model_dir() / "config.json"
    raw = json.loads(config_file.read_text()).get("id2label") or {} if config_file.is_file() else {}
    return {int(k): str(v) for k, v in raw.items()}


def _texts(body: dict, name: str, limit: int) -> list[str]:
    value = body.get(name)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
        raise bad_request(f"'{name}' must be a non-empty string or a non-empty list of non-empty strings", name)
    if len(items) > limit:
        raise bad_request(f"'{name}' holds {len(items)} texts; at most {limit} a request (max_pooling_inputs)", name)
    return items


async def _scores(shim: OpenAIShim, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """A cross-encoder's score of each (query, document) pair; an embedding model's cosine similarity of the two
    texts' embeddings (as vLLM scores with one)."""
    if "embed" in await model_tasks(shim):
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors, tokens = await _pool_all(shim, [{"input": t, "pooling_params": {"task": "embed"}} for t in texts])
        by_text = dict(zip(texts, vectors, strict=True))
        return [_cosine(by_text[q], by_text[d]) for q, d in pairs], tokens
    requests = [{"input": q, "text_pair": d, "pooling_params": {"task": "score"}} for q, d in pairs]
    vectors, tokens = await _pool_all(shim, requests)
    return [v[0] for v in vectors], tokens


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0


async def score(shim: OpenAIShim, body: dict) -> dict:
    """vLLM's /score: `text_1` against `text_2`, 1:1, 1:N or N:N (pairwise)."""
    refuse_unknown_fields(body, {"model", "text_1", "text_2", "user", "truncate_prompt_tokens"})
    await shim.resolve_model(model_field(body))
    limit = await max_pooling_inputs(shim)
    first, second = _texts(body, "text_1", limit), _texts(body, "text_2", limit)
    if len(first) not in (1, len(second)):
        raise bad_request(f"'text_1' must hold 1 text or as many as 'text_2' ({len(second)}); got {len(first)}",
                          "text_1")
    pairs = list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))
    values, tokens = await _scores(shim, pairs)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)]
    return {**_header(shim, "score"), "data": data, "usage": _usage(tokens)}


async def rerank(shim: OpenAIShim, body: dict) -> dict:
    """Jina's / Cohere's rerank: `query`, `documents`, `top_n`, `return_documents`; results by score."""
    refuse_unknown_fields(body, {"model", "query", "documents", "top_n", "return_documents", "user"})
    await shim.resolve_model(model_field(body))
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("'query' must be a non-empty string", "query")
    documents = _texts(body, "documents", await max_pooling_inputs(shim))
    top_n = body.get("top_n", len(documents))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise bad_request("'top_n' must be an integer >= 1", "top_n")
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise bad_request("'return_documents' must be a boolean", "return_documents")
    values, tokens = await _scores(shim, [(query, d) for d in documents])
    order = sorted(range(len(documents)), key=lambda i: -values[i])[:top_n]
    results = [{"index": i, "relevance_score": values[i], **({"document": {"text": documents[i]}} if keep else {})}
               for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": shim.model_name, "usage": {"total_tokens": tokens},
            "results": results}


ROUTES: dict[str, Callable[[OpenAIShim, dict], Awaitable[dict]]] = {
    "/v1/embeddings": embeddings, "/pooling": pooling, "/classify": classify, "/score": score, "/v1/score": score,
    "/rerank": rerank, "/v1/rerank": rerank, "/v2/rerank": rerank,
}


def add_pooling_routes(app: FastAPI, shim: OpenAIShim, dependencies: list,
                       read_json: Callable[[Request, int], Awaitable[dict]]) -> None:
    """Register the pooling endpoints on the shim's app."""

    def endpoint(handler: Callable[[OpenAIShim, dict], Awaitable[dict]]) -> Callable[[Request], Awaitable[Any]]:
        async def route(request: Request) -> JSONResponse:
            return JSONResponse(await handler(shim, await read_json(request, shim.settings.max_body_bytes)))

        return route

    for path, handler in ROUTES.items():
        app.add_api_route(path, endpoint(handler), methods=["POST"], dependencies=dependencies,
                          name=f"{handler.__name__}{path}")
