"""The engine thread of the llm model: it alone drives the (not thread-safe) LLMEngine, taking requests and
cancellations from its inbox and queueing every output, metric and final response on the outbox."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future

from pagedserve.backend.core.errors import ErrorKind, ShuttingDownError
from pagedserve.backend.core.outputs import RequestOutput
from pagedserve.backend.triton.lora import run_lora_control
from pagedserve.backend.triton.messages import (
    Cancel,
    ControlRequest,
    CountStepFailure,
    Fence,
    GrammarReady,
    InboxItem,
    InFlight,
    SendCancelled,
    SendControl,
    SendError,
    SendOutput,
    Sent,
    Stop,
    Unloading,
    UpdateStats,
)
from pagedserve.backend.triton.protocols import EngineClient, Log, PythonLog
from pagedserve.backend.triton.responses import Outbox
from pagedserve.backend.triton.settings import (
    FIRST_TOKEN_WAIT_SECONDS,
    FIRST_TOKEN_WAIT_STEP_FRACTION,
    STATS_INTERVAL_SECONDS,
    ModelSettings,
)

SHUTTING_DOWN = "the llm model is shutting down"  # every request refused or ended for an unload says this


def first_tokens(output: RequestOutput) -> bool:
    """True when this output carries its request's first generated tokens."""
    first = output.outputs[0] if output.outputs else None
    return first is not None and 0 < len(first.token_ids) == len(first.token_ids_delta)


def _starts_or_ends(output: RequestOutput) -> bool:
    """True for a request's first tokens or its last output: the moments a client checks metrics at."""
    return output.finished or first_tokens(output)


class EngineLoop:
    """Owns the engine and the requests it runs; everything here runs on the engine thread, except
    `step_seconds`, which the cancel watcher reads."""

    def __init__(self, engine: EngineClient, settings: ModelSettings, outbox: Outbox, watch: queue.SimpleQueue,
                 log: Log | None = None):
        self.engine = engine
        self._log = log or PythonLog()
        self.inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self.step_seconds = 0.0
        self._settings = settings
        self._outbox = outbox
        self._watch = watch
        self._active: dict[str, InFlight] = {}
        self._compiling: dict[str, InFlight] = {}  # waiting for their grammar, not in the engine yet
        self._grace_over = False  # the in-flight requests were ended for the unload
        self._ended_in_step = 0  # requests the last step ended, and when it ended
        self._step_end = 0.0
        self._last_stats = 0.0
        # Called once, with the reason, when the engine can run no further step (the model then asks to be
        # unloaded, so that it reads not ready).
        self.on_broken: Callable[[str], None] | None = None

    def run(self) -> None:
        """Serve until Stop."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not busy:
                self._outbox.put(UpdateStats(engine.get_stats()))
            # Idle: block until a request (or a cancellation) arrives, so its first step starts at once.
            items = self._drain_inbox(block=not busy)
            if self._ended_in_step:
                items = self._await_replacements(items)
            for item in items:
                if isinstance(item, Stop):
                    self._end_all()
                    return
                if isinstance(item, Unloading):
                    self._grace_over = True
                    self._end_all()
                elif isinstance(item, Cancel):
                    self._abort(item.request_id)
                elif isinstance(item, ControlRequest):
                    self._control(item)
                elif isinstance(item, GrammarReady):
                    request = self._compiling.pop(item.request_id, None)
                    if request is not None:  # else it was cancelled or ended meanwhile
                        self._admit(request)
                else:
                    self._add(item)
            if engine.has_unfinished_requests():
                self._step()

    def _drain_inbox(self, block: bool) -> list[InboxItem]:
        items = [self.inbox.get()] if block else []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items
            if isinstance(items[-1], Stop):
                return items

    def _await_replacements(self, items: list[InboxItem]) -> list[InboxItem]:
        """The admission window: after a step that ended N requests, wait until N new ones are in `items` or
        the window since that step's end is over."""
        wanted = self._ended_in_step - sum(isinstance(item, InFlight) for item in items)
        self._ended_in_step = 0
        window = min(self._settings.admission_window, self._settings.admission_fraction * self.step_seconds)
        deadline = self._step_end + window
        while wanted > 0 and not any(isinstance(item, Stop) for item in items):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = self.inbox.get(timeout=remaining)
            except queue.Empty:
                break
            items.append(item)
            wanted -= isinstance(item, InFlight)
        return items

    def _add(self, request: InFlight) -> None:
        self._outbox.assign(request)
        if self._grace_over:
            # execute() passed it just before the cancel watcher closed the model: end it as the others were.
            self._outbox.put_for(request, SendError(request, ShuttingDownError(SHUTTING_DOWN)))
            return
        if self._images_pending(request):
            return
        spec = request.inputs.params.structured_outputs
        if spec:
            # A grammar not compiled yet is compiled on the grammar thread while the engine steps on; the
            # request joins the engine when it is ready (a compile error is then its refusal).
            future = self.engine.structured.compile_async(spec)
            if not future.done():
                self._compiling[request.request_id] = request
                self._watch.put(request)
                future.add_done_callback(lambda _, rid=request.request_id: self.inbox.put(GrammarReady(rid)))
                return
        self._admit(request, watch=True)

    def _images_pending(self, request: InFlight) -> bool:
        """Start processing the request's images on the image thread while the engine steps on; True while it
        waits for them, holding no KV (it joins the engine when they are ready, a refusal then its error)."""
        inputs = request.inputs
        processor = getattr(self.engine, "image_processor", None)
        if inputs.images is None or processor is None or isinstance(inputs.images, Future):
            return False  # a text-only model's engine refuses the images itself
        inputs.images = processor.process_async(inputs.prompt, inputs.images, inputs.add_special_tokens)
        self._compiling[request.request_id] = request
        self._watch.put(request)
        inputs.images.add_done_callback(lambda _, rid=request.request_id: self.inbox.put(GrammarReady(rid)))
        return True

    def _admit(self, request: InFlight, watch: bool = False) -> None:
        """Add the request to the engine; a refusal is its error response."""
        inputs = request.inputs
        try:
            if inputs.pooling is not None:
                self.engine.add_pooling_request(request.request_id, inputs.prompt, inputs.pooling.params,
                                                inputs.prompt_token_ids, inputs.pooling.text_pair,
                                                arrival_time=request.arrival, timeout=inputs.timeout)
            else:
                self.engine.add_request(request.request_id, inputs.prompt, inputs.params,
                                        prompt_token_ids=inputs.prompt_token_ids, images=inputs.images,
                                        add_special_tokens=inputs.add_special_tokens, arrival_time=request.arrival,
                                        priority=inputs.priority, timeout=inputs.timeout)
        except Exception as error:  # noqa: BLE001 - every failure becomes this request's error response
            self._outbox.put_for(request, SendError(request, error))
            return
        self._active[request.request_id] = request
        if watch:
            self._watch.put(request)

    def _control(self, item: ControlRequest) -> None:
        """Run a lora_control between steps (a load blocks them for as long as it reads the adapter)."""
        try:
            answer = run_lora_control(self.engine, item.control)
        except Exception as error:  # noqa: BLE001 - a refused or failed load is this request's error response
            self._outbox.put(SendControl(item.sender, error=error))
            return
        self._outbox.put(SendControl(item.sender, answer))
        self._outbox.put(UpdateStats(self.engine.get_stats()))

    def _abort(self, request_id: str) -> None:
        """Abort a request the client cancelled, unless it already ended."""
        request = self._active.pop(request_id, None)
        if request is not None:
            self.engine.abort_request(request_id)
        else:
            request = self._compiling.pop(request_id, None)
        if request is not None:
            self._outbox.put_for(request, SendCancelled(request))

    def _step(self) -> None:
        """Run one engine step and queue its outputs, metrics and responses in the order they should go out."""
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
            self._fail_batch(error)
            return
        self._check_broken()
        failed = [output for output in outputs if output.error_kind is ErrorKind.INTERNAL]
        if failed:
            self._log.log_error(f"pagedserve engine step failed ({failed[0].error}); "
                                      f"ended {len(failed)} request(s) with an error")
            self._outbox.put(CountStepFailure())
        now = time.monotonic()
        firsts, later, finals = self._sort_outputs(outputs, now)
        for item in firsts:
            # A first token goes out before the step's other tokens: its client waits for a sign of life.
            self._outbox.put_for(item.request, item)
        firsts_sent = self._outbox.marker(Sent) if firsts else None
        for item in later:
            self._outbox.put_for(item.request, item)
        # Metrics after the tokens that carry on and before the final responses: a client that got its last
        # response then reads /metrics sees this step.
        if now - self._last_stats >= STATS_INTERVAL_SECONDS or any(map(_starts_or_ends, outputs)):
            self._outbox.put(UpdateStats(self.engine.get_stats()))
            self._last_stats = now
        if finals and self._outbox.threads > 1:
            self._outbox.marker(Fence)  # the other threads' finals wait for thread 0's metrics
        for item in finals:
            self._outbox.put_for(item.request, item)
        self._ended_in_step, self._step_end, self.step_seconds = len(finals), now, now - started
        if firsts_sent is not None:
            firsts_sent.wait(min(FIRST_TOKEN_WAIT_SECONDS, FIRST_TOKEN_WAIT_STEP_FRACTION * self.step_seconds))

    def _check_broken(self) -> None:
        """Report, once, an engine that cannot run another step (its failed step's requests already ended)."""
        reason = self.engine.failure() if self.on_broken is not None else None
        if reason is not None:
            report, self.on_broken = self.on_broken, None
            report(reason)

    def _sort_outputs(self, outputs: list[RequestOutput], now: float
                      ) -> tuple[list[SendOutput], list[SendOutput], list[SendOutput]]:
        """(first tokens, other tokens, final outputs) of a step; ended requests leave `_active`."""
        firsts, later, finals = [], [], []
        for output in outputs:
            request = self._active.get(output.request_id)
            if request is None:
                continue  # cancelled meanwhile
            item = SendOutput(request, output, now)
            if output.finished:
                del self._active[output.request_id]
                finals.append(item)
            elif first_tokens(output):
                firsts.append(item)
            else:
                later.append(item)
        return firsts, later, finals

    def _fail_batch(self, error: Exception) -> None:
        """A step raised: end every running request with an error and keep serving."""
        self._log.log_error(f"pagedserve engine step failed: {error!r}")
        self._outbox.put(CountStepFailure())
        for request_id, request in self._active.items():
            self.engine.abort_request(request_id)
            self._outbox.put_for(request, SendError(request, RuntimeError(f"engine step failed: {error}")))
        self._active.clear()

    def _end_all(self) -> None:
        """End every running and queued request with an error: the model is shutting down."""
        error = ShuttingDownError(SHUTTING_DOWN)
        pending = [*self._active.values(), *self._compiling.values()]
        self._compiling.clear()
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, InFlight):
                pending.append(item)
            elif isinstance(item, ControlRequest):
                self._outbox.put(SendControl(item.sender, error=error))
            elif isinstance(item, Stop):
                self.inbox.put(item)  # for the loop, which ends after this
                break
        for request in pending:
            if request.request_id in self._active:
                self.engine.abort_request(request.request_id)
            self._outbox.put_for(request, SendError(request, error))
        self._active.clear()
