"""The one gRPC stream client of the tests: requests go out on a bidirectional stream, and every answer
comes back in order, stamped with the time it arrived."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

from tests.support.inputs import grpc_inputs

ANSWER_TIMEOUT_SECONDS = 120


@dataclass
class Answer:
    """One call of the stream callback: a result or an error, and when it arrived (time.monotonic)."""

    arrived: float
    result: grpcclient.InferResult | None
    error: Exception | None

    @property
    def final(self) -> bool:
        """Whether this is the request's last answer (an error, or Triton's final flag)."""
        if self.error is not None:
            return True
        return self.result.get_response().parameters["triton_final_response"].bool_param


@dataclass
class StreamResult:
    """Everything one request got back: its responses with outputs, in order, or the error that ended it."""

    responses: list[grpcclient.InferResult]
    error: Exception | None

    def outputs(self, name: str) -> list[np.ndarray]:
        """The `name` tensor of every response that carries it."""
        return [r.as_numpy(name) for r in self.responses if r.as_numpy(name) is not None]

    def texts(self, name: str = "text_output") -> list[str]:
        """The first element of `name` in every response, decoded."""
        return [array.reshape(-1)[0].decode() for array in self.outputs(name)]

    def counts(self) -> list[int]:
        """num_output_tokens of every response (asked for with return_num_output_tokens)."""
        return [int(array.reshape(-1)[0]) for array in self.outputs("num_output_tokens")]

    def finals(self) -> list[bool]:
        """The triton_final_response flag of every response."""
        return [r.get_response().parameters["triton_final_response"].bool_param for r in self.responses]


class GrpcStream:
    """One gRPC bidirectional stream to tritonserver. Close it (or use it as a context manager)."""

    def __init__(self, grpc_url: str) -> None:
        self._answers: queue.Queue[Answer] = queue.Queue()
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._client.start_stream(callback=lambda result, error: self._answers.put(
            Answer(time.monotonic(), result, error)))
        self._closed = False

    def send(self, model: str, values: dict[str, object], request_id: str = "", *, priority: int = 0,
             timeout: int | None = None) -> None:
        """Send one request built by `grpc_inputs`; its final response is always sent, empty or not.
        `priority` and `timeout` (microseconds) are Triton's own request fields, as tritonclient sets them."""
        self._client.async_stream_infer(model, grpc_inputs(values), request_id=request_id,
                                        enable_empty_final_response=True, priority=priority, timeout=timeout)

    def next(self, timeout: float = ANSWER_TIMEOUT_SECONDS) -> Answer:
        """The next answer; queue.Empty if none comes within `timeout` seconds."""
        return self._answers.get(timeout=timeout)

    def waiting(self) -> int:
        """How many answers arrived and were not read yet."""
        return self._answers.qsize()

    def collect(self, timeout: float = ANSWER_TIMEOUT_SECONDS) -> StreamResult:
        """The answers of the request in flight, read until its final response or error."""
        responses = []
        while True:
            answer = self.next(timeout)
            if answer.error is not None:
                return StreamResult(responses, answer.error)
            if not answer.final or answer.result.get_response().outputs:
                responses.append(answer.result)
            if answer.final:
                return StreamResult(responses, None)

    def close(self, cancel: bool = False) -> None:
        """End the stream: cancel what is in flight, or wait for it to end."""
        if not self._closed:
            self._closed = True
            self._client.stop_stream(cancel_requests=cancel)
            self._client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
