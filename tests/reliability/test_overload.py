"""Overload and cancellation through Triton gRPC on a 48-block KV pool: 500 streams at concurrency 64 (which
forces preemption) each equal their solo output with no response lost or duplicated, and 100 clients that
cancel or disconnect at random points leave the server serving with every block freed."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.servers import RunningTriton
from tests.support.streams import GrpcStream, StreamResult

pytestmark = pytest.mark.slow

NUM_REQUESTS = 500
CONCURRENCY = 64
NUM_PROMPTS = 25
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _prompt(i: int) -> str:
    return f"Request {i}: the quick brown fox jumps over lazy dog {i * 7}"


def _stream_worker(url: str, jobs: list[int]) -> dict[int, StreamResult]:
    """Send `jobs` one after another on one gRPC stream, collecting every response of each."""
    results = {}
    with GrpcStream(url) as stream:
        for job in jobs:
            stream.send("llm", {
                "text_input": _prompt(job % NUM_PROMPTS), "stream": True, "sampling_parameters": GREEDY,
                "exclude_input_in_output": True, "return_num_output_tokens": True,
            }, request_id=f"overload-{job}")
            results[job] = stream.collect()
    return results


def test_500_streams_at_concurrency_64_with_preemption_each_equal_their_solo_output(small_pool_server):
    solo = []
    for i in range(NUM_PROMPTS):
        result = small_pool_server.grpc_stream("llm", {"text_input": _prompt(i), "sampling_parameters": GREEDY,
                                                       "exclude_input_in_output": True})
        assert result.error is None
        solo.append(result.texts()[0])
    preemptions_before = small_pool_server.metric("vllm:num_preemptions_total")
    jobs = [list(range(w, NUM_REQUESTS, CONCURRENCY)) for w in range(CONCURRENCY)]
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        parts = list(pool.map(lambda js: _stream_worker(small_pool_server.grpc_url, js), jobs))
    answers = {job: answer for part in parts for job, answer in part.items()}
    assert sorted(answers) == list(range(NUM_REQUESTS))
    for job, answer in answers.items():
        assert answer.error is None, (job, answer.error)
        assert {r.get_response().id for r in answer.responses} == {f"overload-{job}"}
        # One response per token, in order: nothing lost, nothing duplicated (recomputation after a
        # preemption must not resend tokens).
        assert answer.counts() == list(range(1, MAX_TOKENS + 1)), (job, answer.counts())
        assert "".join(answer.texts()) == solo[job % NUM_PROMPTS], job
    small_pool_server.wait_idle()
    assert small_pool_server.metric("vllm:num_preemptions_total") > preemptions_before


NUM_CANCELLING_CLIENTS = 100
CANCEL_CONCURRENCY = 25
LONG = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True}


def _cancelling_client(server: RunningTriton, seed: int) -> None:
    """Start a long stream, read a random number of tokens, then cancel it or just drop the connection."""
    rng = random.Random(seed)
    stream = server.open_stream("llm", {
        "text_input": f"Client {seed} counts: one two three", "stream": True, "sampling_parameters": LONG,
    }, request_id=f"cancel-{seed}")
    for _ in range(rng.randint(0, 6)):
        if stream.next().final:
            break
    stream.close(cancel=rng.random() < 0.5)


def test_100_clients_cancelling_or_disconnecting_at_random_points_free_every_block(small_pool_server):
    generated_before = small_pool_server.metric("vllm:generation_tokens_total")
    with ThreadPoolExecutor(max_workers=CANCEL_CONCURRENCY) as pool:
        list(pool.map(lambda seed: _cancelling_client(small_pool_server, seed), range(NUM_CANCELLING_CLIENTS)))
    small_pool_server.wait_idle()
    # The server keeps serving, and cancelled work was really cut short rather than run to the end.
    good = small_pool_server.grpc_stream("llm", {"text_input": "Still there?", "sampling_parameters": {"max_tokens": 3}})
    assert good.error is None and good.texts()[0].startswith("Still there?")
    generated = small_pool_server.metric("vllm:generation_tokens_total") - generated_before
    assert generated < NUM_CANCELLING_CLIENTS * LONG["max_tokens"]
