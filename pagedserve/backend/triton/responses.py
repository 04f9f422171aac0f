"""The response threads of the llm model: each sends its own requests' responses, in order, and makes the
metric round trips once nothing is left to send. A send is a synchronous round trip to tritonserver during
which the thread holds no GIL, so several threads can overlap theirs (config.pbtxt `response_threads`)."""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

from pagedserve.backend.core.errors import error_of_kind
from pagedserve.backend.triton.messages import (
    CountStepFailure,
    Fence,
    InFlight,
    Latch,
    OutboxItem,
    SendCancelled,
    SendControl,
    SendError,
    SendOutput,
    Sent,
    UpdateStats,
)
from pagedserve.backend.triton.protocols import FINAL, Encoder, Log, Metrics, PythonLog, ResponseFactory
from pagedserve.backend.triton.settings import FENCE_TIMEOUT_SECONDS


class Outbox:
    """One queue per response thread. A request's items go to its own thread (its responses stay in order);
    items of no request (metrics) go to thread 0; a marker goes to every thread."""

    def __init__(self, threads: int):
        self.queues: list[queue.SimpleQueue[OutboxItem | None]] = [queue.SimpleQueue() for _ in range(threads)]
        self._next = itertools.count()

    @property
    def threads(self) -> int:
        return len(self.queues)

    def assign(self, request: InFlight) -> None:
        request.shard = next(self._next) % len(self.queues)

    def put(self, item: OutboxItem) -> None:
        """An item of no request (stats, a step failure): thread 0 handles them all, in order."""
        self.queues[0].put(item)

    def put_for(self, request: InFlight, item: OutboxItem) -> None:
        self.queues[request.shard].put(item)

    def marker(self, kind: type[Sent] | type[Fence]) -> Latch:
        """Queue a Sent or Fence marker on every thread; its latch tells when all have reached it."""
        latch = Latch(len(self.queues))
        for q in self.queues:
            q.put(kind(latch))
        return latch

    def stop(self) -> None:
        for q in self.queues:
            q.put(None)


def send_final(request: InFlight, response: Any) -> None:
    """Send a request's last response; the cancel watcher stops asking about it first."""
    with request.lock:
        request.closed = True
    request.sender.send(response, flags=FINAL)


class ResponseThread:
    """One response thread: its queue, and the latency observations it has put off. `responses` builds what
    the senders send (tensors.TritonResponses in the model)."""

    def __init__(self, shard: int, outbox: Outbox, metrics: Metrics, responses: ResponseFactory,
                 log: Log | None = None):
        self.encoder: Encoder | None = None  # set once the engine (and its tokenizer) has loaded
        self._inbox = outbox.queues[shard]
        self._metrics = metrics
        self._responses = responses
        self._log = log or PythonLog()
        self._pending_latencies: list[tuple[str, float]] = []
        self.thread = threading.Thread(target=self._run, name=f"pagedserve-responses-{shard}", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self._observe_pending()  # nothing left to send: now the metric round trips
                item = self._inbox.get()
            if item is None:
                break
            try:
                self._handle(item)
            except Exception as error:  # noqa: BLE001 - one bad response must not stop the others
                self._log.log_error(f"pagedserve response thread: {error!r}")
                if isinstance(item, SendOutput):
                    self._try_send_error(item.request, error)

    def _handle(self, item: OutboxItem) -> None:
        if isinstance(item, SendOutput | SendError | SendCancelled) and item.request.closed:
            return  # a failed response ended it early: its sender takes nothing after the FINAL one
        if isinstance(item, SendOutput):
            self._send_output(item.request, item.output, item.now)
        elif isinstance(item, SendError):
            send_final(item.request, self._responses.error(item.error))
        elif isinstance(item, SendCancelled):
            send_final(item.request, self._responses.cancelled())
        elif isinstance(item, SendControl):
            response = (self._responses.error(item.error) if item.error is not None
                        else self._responses.control(item.answer))
            item.sender.send(response, flags=FINAL)
        elif isinstance(item, UpdateStats):
            self._metrics.update(item.stats)
        elif isinstance(item, CountStepFailure):
            self._metrics.count_step_failure()
        elif isinstance(item, Sent):
            item.latch.arrive()
        elif isinstance(item, Fence):
            item.latch.arrive()
            if not item.latch.wait(FENCE_TIMEOUT_SECONDS):
                self._log.log_warn("pagedserve response thread: a fence timed out; sending on")

    def _try_send_error(self, request: InFlight, error: BaseException) -> None:
        """End a request whose response could not be built; the client may already be gone."""
        try:
            send_final(request, self._responses.error(error))
        except Exception as send_error:  # noqa: BLE001
            self._log.log_error(f"pagedserve could not end request {request.request_id}: {send_error!r}")

    def _send_output(self, request: InFlight, output: Any, now: float) -> None:
        num_new = sum(len(c.token_ids_delta) for c in output.outputs)
        latency = None
        if num_new:
            if request.last_token_time is None:
                latency = ("ttft", now - request.arrival)
            else:
                latency = ("itl", now - request.last_token_time)
            request.last_token_time = now
        if not output.finished and not output.error:
            # Each observation is a round trip to the server: they wait until the queued responses are out.
            if request.inputs.stream and num_new:
                tensors = self.encoder.tensors(request, output)
                request.sender.send(self._responses.output(tensors), flags=0)
            if latency:
                self._pending_latencies.append(latency)
            return
        # The last response goes out after its observations, so /metrics already counts the request.
        self._observe_pending()
        if latency:
            self._metrics.observe(*latency)
        if output.finished:
            self._metrics.observe("e2e", now - request.arrival)
        if output.error:
            send_final(request, self._responses.error(error_of_kind(output.error_kind, output.error)))
            return
        send_final(request, self._responses.output(self.encoder.tensors(request, output)))

    def _observe_pending(self) -> None:
        """Make the latency observations this thread's streamed responses put off."""
        pending, self._pending_latencies = self._pending_latencies, []
        try:
            for latency in pending:
                self._metrics.observe(*latency)
        except Exception as error:  # noqa: BLE001 - a failed observation must not stop the responses
            self._log.log_error(f"pagedserve response thread: a latency observation failed: {error!r}")
