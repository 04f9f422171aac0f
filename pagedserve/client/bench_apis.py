"""`pagedserve bench --endpoint responses|messages`: one streamed request through OpenAI's Responses API or
Anthropic's Messages API, timed as the chat endpoint is (a text delta is a token arrival)."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.client.bench import RequestResult, WorkItem, _TokenClock


def _body(endpoint: str, model: str, item: WorkItem) -> dict:
    if endpoint == "responses":
        return {"model": model, "input": item.prompt, "max_output_tokens": item.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "store": False}
    return {"model": model, "messages": [{"role": "user", "content": item.prompt}], "max_tokens": item.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True}


def _read(endpoint: str, event: dict, result: RequestResult) -> bool:
    """Record what one event says; True when it brought text."""
    kind = event.get("type")
    if endpoint == "responses":
        if kind in ("response.completed", "response.incomplete") and event["response"].get("usage"):
            usage = event["response"]["usage"]
            result.prompt_tokens, result.output_tokens = usage["input_tokens"], usage["output_tokens"]
        return kind in ("response.output_text.delta", "response.reasoning_text.delta") and bool(event["delta"])
    if kind == "message_start":
        result.prompt_tokens = event["message"]["usage"]["input_tokens"]
    elif kind == "message_delta":
        result.output_tokens = event["usage"]["output_tokens"]
    delta = event.get("delta") or {}
    return kind == "content_block_delta" and bool(delta.get("text") or delta.get("thinking"))


async def api_request(http: Any, url: str, model: str, item: WorkItem, endpoint: str,
                      api_key: str | None) -> RequestResult:
    """Stream one request to `{url}/responses` or `{url}/messages`."""
    headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    result = RequestResult(ok=False)
    clock = _TokenClock(result)
    try:
        async with http.stream("POST", f"{url}/{endpoint}", json=_body(endpoint, model, item),
                               headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("type") in ("error", "response.failed"):
                    result.error = json.dumps(event)[:200]
                    return result
                if _read(endpoint, event, result):
                    clock.token()
    except Exception as error:  # every failure is counted, none stops the run
        result.error = str(error)
        return result
    return clock.finish()
