"""Request priority and timeout through the real tritonserver, on a server of its own whose engine runs one
sequence at a time under the priority policy, so a long "blocker" request saturates it.

Triton 2.51 gives a Python model no access to its own request priority (tritonclient's `priority=`), so the
priority travels as `priority` in sampling_parameters (vLLM's field) or as the generate endpoint's `priority`
field; the timeout is Triton's own (tritonclient's `timeout=`, in microseconds) or the generate field.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import CPU_FP32, RunningTriton, triton_running
from tests.support.streams import GrpcStream

pytestmark = pytest.mark.slow

PARAMS = {
    **CPU_FP32,
    "scheduling_policy": "priority",
    "max_num_seqs": "1",
    "max_model_len": "1024",
    "num_blocks": "256",
}
BLOCKER = {"text_input": "Once upon a time", "stream": True,
           "sampling_parameters": {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}}
WAIT_SECONDS = 60


def short(priority: int | None = None, max_tokens: int = 4) -> dict:
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    if priority is not None:
        params["priority"] = priority
    return {"text_input": "The capital of France is", "stream": True, "sampling_parameters": params}


@pytest.fixture(scope="module")
def server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp("priority-triton"), PARAMS,
                        llm_only=True) as running:
        yield running


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def start_blocker(server: RunningTriton) -> GrpcStream:
    """A long request holding the engine's only sequence slot, once its first token is out."""
    stream = server.open_stream("llm", BLOCKER)
    answer = stream.next()
    assert answer.error is None and not answer.final
    return stream


def still_running(stream: GrpcStream) -> bool:
    """Whether no answer read off `stream` so far ended its request."""
    while stream.waiting():
        answer = stream.next()
        if answer.final:
            return False
    return True


def finished_at(stream: GrpcStream) -> float:
    """Read a request's answers to its end; when the last arrived (it must not be an error)."""
    while True:
        answer = stream.next()
        assert answer.error is None, answer.error
        if answer.final:
            return answer.arrived


def test_waiting_requests_are_served_by_priority_once_the_engine_frees_up(server):
    blocker = start_blocker(server)
    streams = {}
    for name, priority in (("five", 5), ("one", 1), ("three", 3), ("one-later", 1)):
        # Long enough (one sequence at a time) that the order of their ends is far above the clients' jitter.
        streams[name] = server.open_stream("llm", {**short(priority, max_tokens=64), "stream": False})
    until(lambda: server.metric("vllm:num_requests_waiting") == 4, "all four queued behind the blocker")
    blocker.close(cancel=True)
    done = {name: finished_at(stream) for name, stream in streams.items()}
    for stream in streams.values():
        stream.close()
    assert sorted(done, key=done.get) == ["one", "one-later", "three", "five"]
    server.wait_idle()


def test_a_more_urgent_request_preempts_the_running_one_and_ends_first(server):
    blocker = start_blocker(server)
    preemptions = server.metric("vllm:num_preemptions_total")
    with server.open_stream("llm", short(priority=-1)) as urgent:
        finished_at(urgent)
    assert still_running(blocker)  # the blocker gave its slot up and waits; its stream is open
    until(lambda: server.metric("vllm:num_preemptions_total") > preemptions, "a preemption counted")
    # The generate endpoint's own `priority` field works the same way.
    events = server.generate_stream("llm", {**short(), "sampling_parameters": '{"max_tokens": 3}',
                                            "priority": -2})
    assert len(events) == 3 and "error" not in events[-1]
    assert still_running(blocker)
    blocker.close(cancel=True)
    server.wait_idle()


def test_a_waiting_request_whose_timeout_passes_gets_a_timeout_error_and_the_server_goes_on(server):
    blocker = start_blocker(server)
    with GrpcStream(server.grpc_url) as waiting:
        sent = time.monotonic()
        waiting.send("llm", short(), timeout=300_000)  # 0.3 s, Triton's microseconds
        answer = waiting.next()
    assert answer.error is not None and answer.arrived - sent >= 0.3
    assert "request timeout expired" in str(answer.error) and "0.3 s" in str(answer.error)
    assert str(answer.error).endswith("[kind=timeout]")
    assert still_running(blocker)
    blocker.close(cancel=True)
    server.wait_idle()
    assert server.grpc_stream("llm", short()).error is None


def test_a_running_request_whose_timeout_passes_ends_with_an_error_after_its_tokens(server):
    with GrpcStream(server.grpc_url) as stream:
        stream.send("llm", BLOCKER, timeout=500_000)
        answers = []
        while not answers or not answers[-1].final:
            answers.append(stream.next())
    assert answers[-1].error is not None and "[kind=timeout]" in str(answers[-1].error)
    assert len(answers) > 1 and all(a.error is None for a in answers[:-1])  # tokens streamed first
    server.wait_idle()  # its KV blocks are back
    assert server.grpc_stream("llm", short()).error is None


def test_the_generate_endpoints_timeout_field_ends_the_request_with_a_timeout_error(server):
    body = {**BLOCKER, "stream": False, "timeout": 200_000}
    status, text = server.post("/v2/models/llm/generate", body)
    assert status != 200 and "kind=timeout" in text, (status, text)
    server.wait_idle()


def test_tritonclients_own_priority_is_accepted_and_the_request_served(server):
    with GrpcStream(server.grpc_url) as stream:
        stream.send("llm", short(), priority=3)
        finished_at(stream)
