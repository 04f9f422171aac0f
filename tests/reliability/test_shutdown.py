"""A server with room for 2 running and 4 waiting requests: one more is refused at once with "server busy"
(UNAVAILABLE over gRPC, 503 over HTTP), and SIGTERM under load ends every in-flight request (finished or
with UNAVAILABLE once the shutdown grace is over) and leaves no process behind."""

from __future__ import annotations

import queue
import signal
import time

import pytest

from pagedserve.backend.core.errors import ErrorKind, WireError, from_wire
from pagedserve.client.launcher import process_group_members
from tests.support.servers import CPU_FP32, RunningTriton
from tests.support.streams import GrpcStream

pytestmark = pytest.mark.slow

LLM_PARAMS = {
    **CPU_FP32,
    "block_size": "16",
    "num_blocks": "256",
    "max_model_len": "1024",
    "max_num_seqs": "2",
    "max_num_batched_tokens": "1024",
    "max_num_waiting": "4",
    # SIGTERM ends what is in flight at once, instead of letting it stream until tritonserver's exit timeout.
    "shutdown_grace_seconds": "0",
}
# Long enough that no request finishes while the test probes (it cancels them after).
FILLER = {"temperature": 0.0, "max_tokens": 1000, "ignore_eos": True}
NUM_FILLERS = 6
LIVENESS_SECONDS = 60
SHUT_DOWN = WireError(ErrorKind.SHUTTING_DOWN, "the llm model is shutting down")


def _start_fillers(running: RunningTriton) -> list[GrpcStream]:
    return [running.open_stream("llm", {"text_input": f"Filler {i} tells a long story:", "stream": True,
                                        "sampling_parameters": FILLER}) for i in range(NUM_FILLERS)]


def _until(condition, what) -> None:
    """Poll `condition` until it holds; `what()` explains a failure (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + LIVENESS_SECONDS
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def _occupancy(running: RunningTriton) -> str:
    return (f"running={running.metric('vllm:num_requests_running')} "
            f"waiting={running.metric('vllm:num_requests_waiting')}")


def _log_tail(running: RunningTriton) -> str:
    return "tritonserver log tail:\n" + running.log_path.read_text(errors="replace")[-3000:]


def _first_answer(stream: GrpcStream) -> tuple[str, object]:
    """("refused", error) or ("accepted", first result) of one stream."""
    answer = stream.next(LIVENESS_SECONDS)
    return ("refused", answer.error) if answer.error is not None else ("accepted", answer.result)


def test_requests_beyond_the_queue_limit_are_refused_at_once_with_server_busy(llm_server):
    running = llm_server
    # Twelve long requests at once: 2 run, 4 wait, and the other 6 are refused before any of the 1000-token
    # requests could finish. A waiting request sends nothing yet, so only refusals and the running two answer.
    burst = [running.open_stream("llm", {"text_input": f"Burst {i} tells a long story:", "stream": True,
                                         "sampling_parameters": FILLER}) for i in range(2 * NUM_FILLERS)]
    try:
        _until(lambda: sum(s.waiting() > 0 for s in burst) >= NUM_FILLERS + 2,
               lambda: f"only {sum(s.waiting() > 0 for s in burst)} streams answered; {_log_tail(running)}")
        first = [_first_answer(stream) for stream in burst if stream.waiting()]
        refused = [str(value) for kind, value in first if kind == "refused"]
        accepted = [value for kind, value in first if kind == "accepted"]
        assert len(refused) == NUM_FILLERS and all("server busy" in text for text in refused), refused
        assert len(accepted) == 2  # the running two stream; the four waiting ones are still queued
        assert not any(r.get_response().parameters["triton_final_response"].bool_param for r in accepted)
        status, text = running.post("/v2/models/llm/generate", {"text_input": "one more", "max_tokens": 2})
        # The model answers UNAVAILABLE; Triton 2.51's generate endpoint reports every model error as a 400
        # (the OpenAI shim turns it into a 503, see below).
        assert status in (400, 503) and "server busy" in text, (status, text)
    finally:
        for stream in burst:
            stream.close(cancel=True)
    running.wait_idle()
    assert running.generate("llm", {"text_input": "Hello", "max_tokens": 2})["text_output"].startswith("Hello")


def test_sigterm_under_load_ends_every_request_and_leaves_no_process(llm_server):
    running, server = llm_server, llm_server.server
    fillers = _start_fillers(running)
    # Every filler in the model (2 running, 4 waiting) before the signal: one still on its way would meet a
    # model Triton has unloaded ("Request for unknown model"), which is Triton's answer, not the model's.
    _until(lambda: (running.metric("vllm:num_requests_running"), running.metric("vllm:num_requests_waiting"))
           == (2, NUM_FILLERS - 2), lambda: f"{_occupancy(running)}; {_log_tail(running)}")
    pgid = server.process.pid
    server.process.send_signal(signal.SIGTERM)
    endings = []
    for index, stream in enumerate(fillers):
        while True:
            try:
                answer = stream.next(LIVENESS_SECONDS)
            except queue.Empty:
                pytest.fail(f"filler {index} got no answer for {LIVENESS_SECONDS} s after SIGTERM "
                            f"(endings so far: {endings}); {_log_tail(running)}")
            if answer.final:
                endings.append("finished" if answer.error is None else answer.error.message())
                break
        stream.close()
    assert len(endings) == NUM_FILLERS
    # Each filler needs ~1000 steps, and the waiting four cannot start before a running one ends: without the
    # grace they would all stream on, finishing one after another, while the server waits for them. With no
    # grace the model ends them as soon as it sees the server stopping (UNAVAILABLE: a client may retry).
    stopped = [ending for ending in endings if from_wire(ending) == SHUT_DOWN]
    assert len(stopped) >= NUM_FILLERS - 2, endings
    assert set(endings) - set(stopped) <= {"finished"}, endings
    # Then tritonserver exits by itself, cleanly (status 0), not killed by its exit timeout.
    assert server.process.wait(timeout=LIVENESS_SECONDS) == 0, _log_tail(running)
    assert "Exit timeout expired" not in running.log_path.read_text(errors="replace")
    # What `pagedserve serve` does on SIGTERM: wait for tritonserver, then kill whatever is left of its group.
    server.stop()
    _until(lambda: not process_group_members(pgid), lambda: f"left behind: {process_group_members(pgid)}")


def test_a_busy_refusal_is_a_503_server_busy_in_the_openai_shim():
    from pagedserve.backend.core.errors import ServerBusyError, to_wire
    from pagedserve.client.openai.errors import triton_api_error
    from pagedserve.client.triton_client import TritonRequestError

    error = triton_api_error(TritonRequestError(to_wire(ServerBusyError("server busy: 4 requests already waiting"))))
    assert error.status == 503 and error.body()["error"]["code"] == "server_busy"
