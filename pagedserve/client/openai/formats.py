"""OpenAI's wire formats: server-sent events, the usage object, and the two logprobs shapes."""

from __future__ import annotations

import json


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
