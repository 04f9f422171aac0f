"""Several response threads (`response_threads` in config.pbtxt): requests are dealt among them, so each
request's responses must still arrive in order and complete, the step's metrics must be on /metrics before
any of its final responses leaves, and the threads' metric calls (which crash tritonserver 2.51 when two
threads make them at once) must not bring the server down.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.servers import CPU_FP32, RunningTriton
from tests.support.streams import StreamResult

pytestmark = pytest.mark.slow

LLM_PARAMS = {
    **CPU_FP32,
    "max_model_len": "1024",
    "max_num_seqs": "32",
    "response_threads": "3",
}
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def _run(running: RunningTriton, prompt: str, stream: bool) -> StreamResult:
    result = running.grpc_stream("llm", {"text_input": prompt, "stream": stream, "sampling_parameters": GREEDY,
                                         "exclude_input_in_output": True, "return_num_output_tokens": True})
    assert result.error is None, result.error
    return result


def test_concurrent_streams_over_three_threads_each_equal_their_solo_output(llm_server):
    prompts = [f"Thread test {i}: a story about the number {i * 11}" for i in range(24)]
    solo = ["".join(_run(llm_server, p, False).texts()) for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        streamed = list(pool.map(lambda p: _run(llm_server, p, True), prompts))
    # In order and whole: the deltas concatenate to the solo text; one token per response, final flag last.
    assert ["".join(r.texts()) for r in streamed] == solo
    for result in streamed:
        assert result.finals()[-1] and not any(result.finals()[:-1])
        assert len(result.responses) == GREEDY["max_tokens"]


def test_the_metrics_count_every_request_once_the_last_response_arrived(llm_server):
    def tokens_total() -> float:
        return llm_server.metric("vllm:generation_tokens_total")

    before = tokens_total()
    prompts = [f"Metrics test {i}: count the tokens of request {i}" for i in range(16)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: _run(llm_server, p, False), prompts))
    # Read at once: thread 0 sends the step's metrics, and the other threads' final responses wait for them.
    assert tokens_total() - before == GREEDY["max_tokens"] * len(prompts)
    assert llm_server.metric("vllm:num_requests_running") == 0
    assert [r.counts()[-1] for r in results] == [GREEDY["max_tokens"]] * len(prompts)
