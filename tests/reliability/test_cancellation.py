"""A request cancelled while it runs ends there: the gRPC client's stream cancel and the OpenAI client's
disconnect both stop generation short of max_tokens and free the request's KV blocks, and the server keeps
serving. The prompts carry PACE_MARKER, so each of their steps takes PACE_SECONDS longer in the fault model:
the tiny model would otherwise run to max_tokens before the cancellation reaches the engine, and the test could
not tell a cancelled request from a finished one."""

from __future__ import annotations

import time

import httpx

from tests.support.faults import PACE_MARKER, PACE_SECONDS
from tests.support.servers import RunningTriton

MAX_TOKENS = 100  # at PACE_SECONDS a step, at least 2 s of running for the cancellation to land in
LIVENESS_SECONDS = 60
assert MAX_TOKENS * PACE_SECONDS >= 2.0


def _until(condition, what: str) -> None:
    """Poll `condition` until it holds (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + LIVENESS_SECONDS
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_stop_stream_with_cancel_ends_the_request_and_frees_its_kv_blocks(small_pool_server: RunningTriton):
    server = small_pool_server
    server.wait_idle()
    before = server.metric("vllm:generation_tokens_total")
    with server.open_stream("llm", {
        "text_input": f"Count with me {PACE_MARKER}:", "stream": True,
        "sampling_parameters": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    }) as stream:
        for _ in range(3):
            assert stream.next(timeout=LIVENESS_SECONDS).error is None
        stream.close(cancel=True)
    server.wait_idle()  # no request left running and every block returned
    generated = server.metric("vllm:generation_tokens_total") - before
    assert 3 <= generated < MAX_TOKENS
    # The server keeps serving after a cancellation.
    assert server.generate("llm", {"text_input": "Hi", "max_tokens": 2})["text_output"]


def test_disconnect_mid_stream_cancels_the_request_and_frees_its_blocks(shim_url: str,
                                                                        small_pool_server: RunningTriton):
    server = small_pool_server
    server.wait_idle()
    before = server.metric("vllm:generation_tokens_total")
    n = 2
    body = {"model": "tiny", "prompt": f"The capital of France {PACE_MARKER} is", "max_tokens": MAX_TOKENS, "n": n,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{shim_url}/v1/completions", json=body, timeout=LIVENESS_SECONDS) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
        # The engine publishes its stats every 0.1 s: wait until they show this request's blocks.
        _until(lambda: server.metric("vllm:kv_cache_usage_perc") > 0, "the request never showed in the KV usage")
    server.wait_idle()
    # Cut short: neither choice ran to its max_tokens.
    assert server.metric("vllm:generation_tokens_total") - before < n * MAX_TOKENS
    completion = httpx.post(f"{shim_url}/v1/completions", timeout=LIVENESS_SECONDS,
                            json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
