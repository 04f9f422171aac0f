"""Fakes for the llm model's threads (pagedserve/backend/triton): a scripted engine, response senders, the
response factory, encoder, metrics and log, and `Glue`, which wires EngineLoop, Outbox and ResponseThreads as
llm_model.py does. No tritonserver, no model: tests/triton asserts the exact sends each request gets."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedserve.backend.core.errors import ErrorKind
from pagedserve.backend.core.outputs import CompletionOutput, EngineStats, RequestOutput
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.triton.engine_loop import EngineLoop
from pagedserve.backend.triton.inputs import LLMRequestInputs
from pagedserve.backend.triton.messages import InFlight, Stop
from pagedserve.backend.triton.protocols import FINAL
from pagedserve.backend.triton.responses import Outbox, ResponseThread
from pagedserve.backend.triton.settings import ModelSettings

JOIN_SECONDS = 10.0  # a liveness bound: every scripted run ends in well under a second


class ListLog:
    """A Log that keeps (level, message) pairs."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def log_info(self, message: str) -> None:
        self.lines.append(("info", message))

    def log_warn(self, message: str) -> None:
        self.lines.append(("warn", message))

    def log_error(self, message: str) -> None:
        self.lines.append(("error", message))


class FakeSender:
    """A response sender that records every send as (response, flags); `cancelled` is what is_cancelled says,
    `events`, when given, is a log shared with other fakes to check the order across threads."""

    def __init__(self, events: list | None = None, is_cancelled: Callable[[], bool] | None = None):
        self.sends: list[tuple[object, int]] = []
        self.polls = 0
        self.done = threading.Event()
        self._events = events
        self._is_cancelled = is_cancelled or (lambda: False)

    def send(self, response: object = None, flags: int = 0) -> None:
        self.sends.append((response, flags))  # one after the FINAL one too: the exact sequences catch it
        if self._events is not None:
            self._events.append(("send", self, response, flags))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        self.polls += 1
        return self._is_cancelled()

    def responses(self) -> list[object]:
        return [response for response, _ in self.sends]

    def flags(self) -> list[int]:
        return [flags for _, flags in self.sends]


class FakeResponses:
    """A ResponseFactory of plain tuples: ("output", tensors), ("error", kind name, message), ("cancelled",)."""

    def output(self, tensors: list) -> tuple:
        return ("output", tensors)

    def error(self, error: BaseException) -> tuple:
        return ("error", type(error).__name__, str(error))

    def cancelled(self) -> tuple:
        return ("cancelled",)

    def control(self, answer: dict) -> tuple:
        return ("control", answer)


class FakeEncoder:
    """An Encoder whose tensors are the completion texts: the deltas when streaming, the whole text else."""

    def tensors(self, request: InFlight, output: RequestOutput) -> list:
        return [c.text_delta if request.inputs.stream else c.text for c in output.outputs]


class FakeMetrics:
    """Metrics that record each call; `update_seconds` makes an update as slow as a round trip could be."""

    def __init__(self, events: list | None = None, update_seconds: float = 0.0):
        self.calls: list[tuple] = []
        self._events = events
        self._update_seconds = update_seconds

    def update(self, stats: EngineStats) -> None:
        time.sleep(self._update_seconds)
        self.calls.append(("update", stats.num_running))
        if self._events is not None:
            self._events.append(("update", stats.num_running))

    def count_step_failure(self) -> None:
        self.calls.append(("step_failure",))

    def observe(self, histogram: str, seconds: float) -> None:
        self.calls.append(("observe", histogram))


class FakeGrammar:
    """A GrammarCompiler whose compiles finish when the test sets their futures' results."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def compile_async(self, spec: dict) -> Future:
        future: Future = Future()
        self.futures.append(future)
        return future


@dataclass
class _Running:
    """One request inside the scripted engine."""

    max_tokens: int
    prompt: str | None
    base: int  # token k of this request is base + k
    token_ids: list[int] = field(default_factory=list)
    aborted: bool = False


class ScriptedEngine:
    """An EngineClient that gives every running request one token per step (token k of a request is
    100 * (its index) + k, text "t<token>"), in the order the requests were added.

    `hooks[n]` runs at the start of step n (1-based), on the engine thread: a test puts a Cancel or Stop in the
    loop's inbox there, at an exact point. `raise_at` steps raise; `fail_at[n]` requests end with an INTERNAL
    error in step n, as when the engine's forward fails for the requests it scheduled (the others wait).
    `on_idle` runs after a step that leaves nothing unfinished. `calls` records add/abort/step/shutdown.
    """

    def __init__(self) -> None:
        self.structured = FakeGrammar()
        self.hooks: dict[int, Callable[[], None]] = {}
        self.raise_at: set[int] = set()
        self.fail_at: dict[int, set[str]] = {}
        self.refuse: dict[str, Exception] = {}
        self.on_idle: Callable[[], None] | None = None
        self.calls: list[tuple] = []
        self.step_seconds = 0.0
        self.steps = 0
        self.loras: dict[str, str] = {}
        self.images: dict[str, object] = {}  # each added request's images, as the loop passed them
        self._running: dict[str, _Running] = {}
        self._added = 0

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    add_special_tokens: bool = True, priority: int = 0, timeout: float | None = None,
                    images: object = None) -> None:
        self.calls.append(("add", request_id))
        if images is not None:  # processed images come as a future, whose refusal is the request's (as LLMEngine)
            self.images[request_id] = images
            if isinstance(images, Future):
                images.result()
        if request_id in self.refuse:
            raise self.refuse[request_id]
        self._added += 1
        self._running[request_id] = _Running((params or SamplingParams()).max_tokens, prompt, 100 * self._added)

    def abort_request(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))
        if request_id in self._running:
            self._running[request_id].aborted = True

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def failure(self) -> str | None:
        return None

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))

    def add_lora(self, name: str, path: str) -> None:
        self.loras[name] = path

    def remove_lora(self, name: str) -> None:
        del self.loras[name]

    def list_loras(self) -> dict[str, str]:
        return dict(self.loras)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        self.calls.append(("step", self.steps))
        hook = self.hooks.get(self.steps)
        if hook is not None:
            hook()
        time.sleep(self.step_seconds)
        if self.steps in self.raise_at:
            raise RuntimeError(f"boom in step {self.steps}")
        failing = self.fail_at.get(self.steps)
        outputs = [self._advance(rid, failing) for rid in list(self._running)]
        if not self._running and self.on_idle is not None:
            self.on_idle()
        return [output for output in outputs if output is not None]

    def _advance(self, request_id: str, failing: set[str] | None) -> RequestOutput | None:
        request = self._running[request_id]
        if request.aborted:
            del self._running[request_id]
            return _output(request_id, request, [], "abort")
        if failing is not None:
            if request_id not in failing:
                return None  # not scheduled in the failing step: it carries on after
            del self._running[request_id]
            output = _output(request_id, request, [], "error")
            output.error, output.error_kind = "RuntimeError: forward failed", ErrorKind.INTERNAL
            return output
        token = request.base + len(request.token_ids)
        request.token_ids.append(token)
        finish = "length" if len(request.token_ids) == request.max_tokens else None
        if finish:
            del self._running[request_id]
        return _output(request_id, request, [token], finish)


def _output(request_id: str, request: _Running, new: list[int], finish: str | None) -> RequestOutput:
    completion = CompletionOutput(index=0, text="".join(f"t{t}" for t in request.token_ids),
                                  token_ids=list(request.token_ids), text_delta="".join(f"t{t}" for t in new),
                                  token_ids_delta=list(new), finish_reason=finish)
    return RequestOutput(request_id, request.prompt, [1, 2], [completion], finished=finish is not None)


def in_flight(request_id: str, sender: FakeSender, max_tokens: int = 3, stream: bool = True,
              prompt: str = "Hello", structured_outputs: dict | None = None) -> InFlight:
    """An llm request as execute() hands it to the engine loop."""
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=structured_outputs)
    return InFlight(request_id, sender, LLMRequestInputs(prompt, None, params, stream=stream), time.monotonic())


class Glue:
    """EngineLoop, Outbox and `threads` ResponseThreads wired as llm_model.py wires them, around `engine`; the
    loop hands the requests to watch to `watch` (a CancelWatcher's queue, or one nobody reads).
    `run()` serves until the engine loop ends (a Stop: by default when the engine goes idle)."""

    def __init__(self, engine: ScriptedEngine, threads: int = 1, metrics: FakeMetrics | None = None,
                 settings: ModelSettings | None = None, stop_when_idle: bool = True,
                 watch: queue.SimpleQueue | None = None):
        self.engine = engine
        self.log = ListLog()
        self.metrics = metrics or FakeMetrics()
        self.outbox = Outbox(threads)
        self.watch: queue.SimpleQueue = watch if watch is not None else queue.SimpleQueue()
        self.loop = EngineLoop(engine, settings or ModelSettings(response_threads=threads), self.outbox,
                               self.watch, self.log)
        self.responders = [ResponseThread(shard, self.outbox, self.metrics, FakeResponses(), self.log)
                           for shard in range(threads)]
        for responder in self.responders:
            responder.encoder = FakeEncoder()
        if stop_when_idle:
            engine.on_idle = self.stop

    def stop(self) -> None:
        self.loop.inbox.put(Stop())

    def submit(self, *items: object) -> None:
        for item in items:
            self.loop.inbox.put(item)

    def run(self) -> None:
        """Run the engine loop and the response threads until the loop ends and every queued send is made."""
        for responder in self.responders:
            responder.thread.start()
        engine_thread = threading.Thread(target=self.loop.run, daemon=True)
        engine_thread.start()
        engine_thread.join(JOIN_SECONDS)
        assert not engine_thread.is_alive(), f"the engine loop did not end; engine calls: {self.engine.calls}"
        self.outbox.stop()
        for responder in self.responders:
            responder.thread.join(JOIN_SECONDS)
            assert not responder.thread.is_alive(), "a response thread did not end"
