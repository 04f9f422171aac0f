"""The admission window: after a step that ended a request, the engine waits (up to `admission_window_ms`)
for its client's next request before the next step, so that request joins the very next step instead of
waiting a whole one out. Here the window is made long (5 s, no cap by step time) so the effect is plain to
see: a client that sends its next request 0.3 s after the previous one ended holds a running stream for
those 0.3 s, and its first token comes with that stream's first token after the pause.
"""

from __future__ import annotations

import queue
import time

import pytest
import tritonclient.grpc as grpcclient

pytestmark = pytest.mark.slow

WINDOW_PARAMS = {
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": "1024",
    "max_num_seqs": "4",
    "admission_window_ms": "5000",
    "admission_window_step_fraction": "1000000",
}
CLIENT_DELAY_SECONDS = 0.3
LIVENESS_SECONDS = 60


@pytest.fixture(scope="module")
def window_server(tiny_llama_path, tmp_path_factory, triton_starter):
    with triton_starter(tiny_llama_path, tmp_path_factory.mktemp("window-triton"), WINDOW_PARAMS,
                        llm_only=True) as (_, running):
        yield running


class TimedStream:
    """One request on its own gRPC stream, each response stamped with its arrival time by the callback."""

    def __init__(self, running, make_inputs, text: str, max_tokens: int):
        self.answers: queue.Queue = queue.Queue()
        self._client = grpcclient.InferenceServerClient(running.grpc_url)
        self._client.start_stream(callback=lambda result, error: self.answers.put((time.monotonic(), result,
                                                                                      error)))
        sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
        self._client.async_stream_infer("llm", make_inputs({"text_input": text, "stream": True,
                                                             "sampling_parameters": sampling}),
                                        enable_empty_final_response=True)

    def arrivals(self, count: int | None = None) -> list[float]:
        """Arrival times of the next `count` responses, or of all until the final one."""
        times = []
        while count is None or len(times) < count:
            arrived, result, error = self.answers.get(timeout=LIVENESS_SECONDS)
            assert error is None, error
            times.append(arrived)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        return times

    def close(self, cancel: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel)
        self._client.close()


def test_a_closed_loop_clients_next_request_joins_the_step_after_its_previous_one_ended(window_server, make_inputs):
    running = window_server
    long = TimedStream(running, make_inputs, "A long story:", 1000)
    try:
        long.arrivals(3)  # the long stream is running
        short = TimedStream(running, make_inputs, "Hello", 2)
        try:
            ended = short.arrivals()[-1]
        finally:
            short.close()
        time.sleep(max(0.0, ended + CLIENT_DELAY_SECONDS - time.monotonic()))
        # Long enough not to end (an ending would open another window) while the long stream is read.
        following = TimedStream(running, make_inputs, "Hello again", 1000)
        try:
            first_token = following.arrivals(1)[0]
            times = long.arrivals(60)
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
