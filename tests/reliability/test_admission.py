"""The admission window: after a step that ended a request, the engine waits (up to `admission_window_ms`)
for its client's next request before the next step, so that request joins the very next step instead of
waiting a whole one out. Here the window is made long (5 s, no cap by step time) so the effect is plain to
see: a client that sends its next request 0.3 s after the previous one ended holds a running stream for
those 0.3 s, and its first token comes with that stream's first token after the pause.
"""

from __future__ import annotations

import time

import pytest

from tests.support.servers import CPU_FP32, RunningTriton
from tests.support.streams import GrpcStream

pytestmark = pytest.mark.slow

LLM_PARAMS = {
    **CPU_FP32,
    "max_model_len": "1024",
    "max_num_seqs": "4",
    "admission_window_ms": "5000",
    "admission_window_step_fraction": "1000000",
}
CLIENT_DELAY_SECONDS = 0.3
LIVENESS_SECONDS = 60


def _start(running: RunningTriton, text: str, max_tokens: int) -> GrpcStream:
    """One greedy request of `max_tokens` on its own gRPC stream."""
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return running.open_stream("llm", {"text_input": text, "stream": True, "sampling_parameters": sampling})


def _arrivals(stream: GrpcStream, count: int | None = None) -> list[float]:
    """Arrival times of the next `count` responses, or of all until the final one."""
    times = []
    while count is None or len(times) < count:
        answer = stream.next(LIVENESS_SECONDS)
        assert answer.error is None, answer.error
        times.append(answer.arrived)
        if answer.final:
            break
    return times


def after_join(times: list[float], first_token: float) -> int:
    """How many of `times` came before `first_token`."""
    return sum(1 for arrived in times if arrived < first_token)


def test_a_closed_loop_clients_next_request_joins_the_step_after_its_previous_one_ended(llm_server):
    long = _start(llm_server, "A long story:", 1000)
    try:
        _arrivals(long, 3)  # the long stream is running
        with _start(llm_server, "Hello", 2) as short:
            ended = _arrivals(short)[-1]
        time.sleep(max(0.0, ended + CLIENT_DELAY_SECONDS - time.monotonic()))
        # Long enough not to end (an ending would open another window) while the long stream is read.
        following = _start(llm_server, "Hello again", 1000)
        try:
            first_token = _arrivals(following, 1)[0]
            # Everything the long stream sent up to a little past the join: its tokens arrive faster than this
            # thread reads them, so a fixed count could end before the pause.
            times = []
            while not times or times[-1] < first_token or len(times) < after_join(times, first_token) + 20:
                times.extend(_arrivals(long, 1))
        finally:
            following.close(cancel=True)
    finally:
        long.close(cancel=True)
    # The long stream paused after the short request ended, until the next request arrived and joined.
    gaps = [(later - earlier, later) for earlier, later in zip(times, times[1:], strict=False)]
    pause, resumed = max(gaps)
    assert pause >= CLIENT_DELAY_SECONDS * 0.8, (pause, sorted(gaps)[-3:])
    assert resumed >= ended + CLIENT_DELAY_SECONDS * 0.8
    # The next request's first token came out of the step that ended the pause.
    assert abs(resumed - first_token) < pause / 2, (resumed - first_token, pause)
