"""What the llm model's threads hand each other: the in-flight request, and typed messages.

execute() -> engine loop (the inbox): an InFlight request, a ControlRequest, Cancel (from the cancel watcher),
Unloading, Stop.
engine loop -> response senders (the outbox): SendOutput, SendError, SendCancelled, SendControl, UpdateStats,
CountStepFailure, and the Sent / Fence markers that order sends across response threads.
engine loop -> cancel watcher: the InFlight requests to watch, None to stop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pagedserve.backend.core.outputs import EngineStats, RequestOutput
from pagedserve.backend.triton.inputs import LLMRequestInputs
from pagedserve.backend.triton.lora import LoRAControl


@dataclass
class InFlight:
    """One user request as the threads see it; the detokenizer offsets belong to its response thread.

    `closed` (under `lock`) is set before the FINAL response is sent: after it the server frees the response
    factory, so the cancel watcher must not ask is_cancelled() any more.
    """

    request_id: str
    sender: Any  # pb_utils.InferenceResponseSender
    inputs: LLMRequestInputs
    arrival: float
    last_token_time: float | None = None
    token_ids: list[int] = field(default_factory=list)  # ensemble path: prompt + completion 0 so far
    prefix_offset: int = 0
    read_offset: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    cancel_reported: bool = False  # cancel watcher only
    prompt_logprobs_sent: bool = False  # response thread only
    shard: int = 0  # the response thread that sends this request's responses


# ---- inbox: to the engine loop


@dataclass(frozen=True)
class Cancel:
    """The client cancelled this request."""

    request_id: str


@dataclass(frozen=True)
class GrammarReady:
    """This request's structured-output grammar finished compiling (or failed to): it may join the engine."""

    request_id: str


@dataclass(frozen=True)
class Unloading:
    """The grace period after the model began unloading is over: end what is in flight."""


@dataclass(frozen=True)
class Stop:
    """finalize(): end what is in flight and leave the loop."""


@dataclass(frozen=True)
class ControlRequest:
    """A lora_control request (pagedserve/backend/triton/lora.py): run on the engine thread, answered with one response."""

    sender: Any  # pb_utils.InferenceResponseSender
    control: LoRAControl


InboxItem = InFlight | ControlRequest | Cancel | GrammarReady | Unloading | Stop


# ---- outbox: to the response senders


class Latch:
    """Counts the response threads that reached a marker; `wait` until all have."""

    def __init__(self, count: int):
        self._left = count
        self._done = threading.Event()
        self._lock = threading.Lock()

    def arrive(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


@dataclass(frozen=True)
class SendOutput:
    """A step's output for one request, made at `now`."""

    request: InFlight
    output: RequestOutput
    now: float


@dataclass(frozen=True)
class SendError:
    """End the request with this error."""

    request: InFlight
    error: BaseException


@dataclass(frozen=True)
class SendCancelled:
    """End the request as cancelled."""

    request: InFlight


@dataclass(frozen=True)
class SendControl:
    """End a lora_control request with its answer (a JSON object) or its error."""

    sender: Any
    answer: dict | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class UpdateStats:
    """Publish the engine's gauges and counters."""

    stats: EngineStats


@dataclass(frozen=True)
class CountStepFailure:
    """An engine step failed: count it."""


@dataclass(frozen=True)
class Sent:
    """Each thread arrives once everything queued before it is sent."""

    latch: Latch


@dataclass(frozen=True)
class Fence:
    """Each thread arrives, then waits until all have: nothing after it goes out before all before it."""

    latch: Latch


OutboxItem = SendOutput | SendError | SendCancelled | SendControl | UpdateStats | CountStepFailure | Sent | Fence
