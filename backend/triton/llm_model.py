"""The decoupled Triton `llm` model: execute() only validates and enqueues; an engine thread drives the
(not thread-safe) LLMEngine; a response thread sends; a cancel thread polls for cancelled requests.
Every request ends with a FINAL response, errors and cancellations included.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from pagedserve.backend.core.errors import ShuttingDownError
from pagedserve.backend.engine.detokenizer import detokenize_incrementally, initial_offsets
from pagedserve.backend.triton.metrics import EngineMetrics
from pagedserve.backend.triton.utils import LLMRequestInputs, error_response, parse_llm_request, string_tensor

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Cancellation polling. is_cancelled() is a round trip to the server process, one per in-flight request, made
# on the cancel thread so the engine thread never waits on them. Each costs both processes CPU (0.3-0.5 ms on
# a busy 2-core machine), and a cancelled request is aborted only between two steps, so each request is asked
# at most once per step: every max(CANCEL_POLL_SECONDS, the last step's duration up to 1 s, in-flight requests /
# CANCEL_POLLS_PER_SECOND) seconds. A cancelled request may so run one step more than with a fixed 50 ms poll;
# at 32 SmolLM2 streams on 2 cores (~0.3 s steps) polling every 50 ms made 640 round trips a second, and
# polling once per step took ~4 ms off the TTFT the Triton path adds (docs/benchmarks.md, 1 Dec).
CANCEL_POLL_SECONDS = 0.05
CANCEL_POLLS_PER_SECOND = 500.0  # the most round trips a second cancellation polling makes, however many requests
# A step longer than this (a long prefill on a CPU) does not slow polling further: the same polls notice the
# model being unloaded (_watch_unloading), which must happen well within the shutdown grace period.
CANCEL_POLL_MAX_STEP_SECONDS = 1.0
STATS_INTERVAL_SECONDS = 0.1
# The longest a thread waits for the GIL while another runs Python (CPython's default is 5 ms). The response
# and cancel threads drop and retake the GIL around every round trip to the server while the engine thread's
# Python between torch ops keeps it busy, so each retake could cost up to 5 ms; with back-to-back steps the
# stub's own threads lagged the same way. Bounding the wait replaces a sleep after every step. Set for the
# whole stub process, which serves only this model.
GIL_SWITCH_INTERVAL_SECONDS = 5e-4
SHUTDOWN_TIMEOUT_SECONDS = 30.0
# When the server stops (SIGTERM) or unloads this model, Triton waits for in-flight requests up to its exit
# timeout (`--exit-timeout-secs`, 30 s by default) and only then calls finalize(); a decoupled request still
# streaming at that moment meets a server that exits under it (tritonserver 2.51 can crash there). The
# cancel thread sees the model stop being ready and gives in-flight requests this long to finish, then ends
# the rest with UNAVAILABLE. config.pbtxt parameter `shutdown_grace_seconds` sets it; keep it below the
# exit timeout.
SHUTDOWN_GRACE_SECONDS = 5.0
READY_POLL_SECONDS = 0.5  # how often the cancel thread asks whether the model is still ready
# Admission window. A client that sends its next request when the previous one ends (a closed loop: a
# worker pool, an agent, a benchmark) reaches the engine a few milliseconds after the step that ended it,
# when the next step has already started, so its request waits one whole step before its prefill begins.
# After a step that ended requests, the engine can wait up to `admission_window_ms` (config.pbtxt) for as
# many new requests as ended, and never longer than `admission_window_step_fraction` of the last step: at
# most that fraction of a step is added to the running streams, and only on such steps. Off by default: on
# SmolLM2 at 8 closed-loop clients (bench/serving.py, 5 ms) it halved the median TTFT (762 -> 376 ms) but
# the new requests' prefills then fell among running decodes, and the ITL p99 went from 69 to 166 ms.
ADMISSION_WINDOW_MS = 0.0
ADMISSION_WINDOW_STEP_FRACTION = 0.1
# Response threads. A send is a synchronous round trip to tritonserver (0.3-0.4 ms) during which the sending
# thread holds no GIL; with one thread a step's 31 first tokens leave one after another (the last ~18 ms
# after the step on a slow 2-core machine). Requests are dealt round-robin to `response_threads`
# (config.pbtxt) threads, each sending its own requests' responses in order, so their round trips can
# overlap. Measured on 2 cores (docs/benchmarks.md): with 4 threads first tokens left sooner (6.8 ms after
# the step on average instead of 9.7) but each send took longer and the TTFT the path adds did not fall, so
# the default is 1; machines with cores to spare may gain.
RESPONSE_THREADS = 1
FENCE_TIMEOUT_SECONDS = 5.0  # a response thread stuck in a send must not stop the others for good
# After a step that made first tokens, the engine thread waits until the response thread has sent them
# before it starts the next step (at most the smaller of these two): sending takes a dozen GIL hand-overs,
# and with the engine thread's Python running each one waits up to the switch interval, so a first token
# took 3-6 ms to leave on SmolLM2 instead of ~0.5 ms. Bounded so that many first tokens in one step cannot
# hold the running streams up for long.
FIRST_TOKEN_WAIT_SECONDS = 0.02
FIRST_TOKEN_WAIT_STEP_FRACTION = 0.05

_INT_PARAMETERS = ("block_size", "num_blocks", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
                   "max_model_len", "max_num_waiting", "seed", "cpu_threads")
_FLOAT_PARAMETERS = ("gpu_memory_utilization",)
_BOOL_PARAMETERS = ("enable_prefix_caching",)
_STRING_PARAMETERS = ("dtype", "device")
_STOP = object()
_UNLOADING = object()  # inbox message from the cancel thread: the grace period after unloading began is over
# Test hook, off unless set in tritonserver's environment: a step that schedules a request whose text_input
# contains this marker raises once, as a failing forward would (tests/reliability uses it).
FAULT_MARKER_ENV = "PAGEDSERVE_TEST_FAULT_MARKER"
SHUTTING_DOWN = "the llm model is shutting down"  # every request refused or ended for an unload says this


def engine_arguments(parameters: dict[str, dict]) -> tuple[str, dict[str, Any]]:
    """(model path, LLMEngine.from_pretrained kwargs) from config.pbtxt `parameters`; "" keeps a default."""
    values = {key: entry.get("string_value", "").strip() for key, entry in parameters.items()}
    kwargs: dict[str, Any] = {}
    for key in _INT_PARAMETERS + _FLOAT_PARAMETERS + _BOOL_PARAMETERS + _STRING_PARAMETERS:
        raw = values.get(key, "")
        if not raw:
            continue
        try:
            if key in _INT_PARAMETERS:
                kwargs[key] = int(raw)
            elif key in _FLOAT_PARAMETERS:
                kwargs[key] = float(raw)
            elif key in _BOOL_PARAMETERS:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                kwargs[key] = raw.lower() in ("true", "1")
            else:
                kwargs[key] = raw
        except ValueError:
            raise ValueError(f"config.pbtxt parameter {key} has a bad value {raw!r}") from None
    return values.get("model", ""), kwargs


def model_number_parameter(parameters: dict[str, dict], key: str, default: float) -> float:
    """A number parameter of the llm model itself (not the engine's): finite and >= 0, `default` when empty."""
    raw = parameters.get(key, {}).get("string_value", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"config.pbtxt parameter {key} must be a number >= 0, got {raw!r}")
    return value


def _first_tokens(output: Any) -> bool:
    """True when this output carries its request's first generated tokens."""
    first = output.outputs[0] if output.outputs else None
    return first is not None and 0 < len(first.token_ids) == len(first.token_ids_delta)


def _starts_or_ends(output: Any) -> bool:
    """True for a request's first tokens or its last output: the moments a client checks metrics at."""
    return output.finished or _first_tokens(output)


@dataclass
class _InFlight:
    """One user request as the threads see it; the detokenizer offsets belong to the response thread.

    `closed` (under `lock`) is set before the FINAL response is sent: after it the server frees the response
    factory, so the cancel thread must not ask is_cancelled() any more.
    """

    request_id: str
    sender: Any
    inputs: LLMRequestInputs
    arrival: float
    last_token_time: float | None = None
    token_ids: list[int] = field(default_factory=list)  # ensemble path: prompt + completion 0 so far
    prefix_offset: int = 0
    read_offset: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    cancel_reported: bool = False  # cancel thread only
    prompt_logprobs_sent: bool = False  # response thread only
    shard: int = 0  # the response thread that sends this request's responses


class _Latch:
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


class _Outbox:
    """One queue per response thread. A request's items go to its own thread (its responses stay in order);
    items of no request (metrics) go to thread 0; a marker goes to every thread."""

    def __init__(self, threads: int):
        self.queues = [queue.SimpleQueue() for _ in range(threads)]
        self._next = itertools.count()

    def assign(self, request: _InFlight) -> None:
        request.shard = next(self._next) % len(self.queues)

    def put(self, item: tuple) -> None:
        """An item of no request ("stats", "step_failure"): thread 0 handles them all, in order."""
        self.queues[0].put(item)

    def put_for(self, request: _InFlight, item: tuple) -> None:
        self.queues[request.shard].put(item)

    def marker(self, kind: str) -> _Latch:
        """("sent", latch): each thread arrives when it gets there, once what was queued before is sent.
        ("fence", latch): each thread also waits there until all have arrived (nothing after it goes out
        before everything before it has)."""
        latch = _Latch(len(self.queues))
        for q in self.queues:
            q.put((kind, latch))
        return latch

    def stop(self) -> None:
        for q in self.queues:
            q.put(None)


@dataclass(frozen=True)
class _Cancel:
    """Inbox message from the cancel thread: the client cancelled this request."""

    request_id: str


class TritonPythonModel:
    """Triton's entry points for the `llm` model."""

    def initialize(self, args: dict) -> None:
        """Start the engine thread (the engine loads there) and the response thread; raise startup errors."""
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the llm model needs `model_transaction_policy { decoupled: true }`")
        parameters = config.get("parameters", {})
        self._model_path, self._engine_kwargs = engine_arguments(parameters)
        self._shutdown_grace = model_number_parameter(parameters, "shutdown_grace_seconds", SHUTDOWN_GRACE_SECONDS)
        self._admission_window = model_number_parameter(parameters, "admission_window_ms", ADMISSION_WINDOW_MS) / 1e3
        self._admission_fraction = model_number_parameter(parameters, "admission_window_step_fraction",
                                                           ADMISSION_WINDOW_STEP_FRACTION)
        self._model_name, self._model_version = args["model_name"], args["model_version"]
        self._metrics = EngineMetrics(args["model_name"], args["model_version"])
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        threads = model_number_parameter(parameters, "response_threads", RESPONSE_THREADS)
        if threads < 1 or threads != int(threads):
            raise ValueError(f"config.pbtxt parameter response_threads must be a whole number >= 1, got {threads:g}")
        threads = int(threads)
        self._outbox = _Outbox(threads)
        self._watch: queue.SimpleQueue = queue.SimpleQueue()  # requests for the cancel thread; None stops it
        self._engine: Any = None
        self._startup = threading.Condition()
        self._started = False
        self._startup_error: BaseException | None = None
        self._closing = False
        self._unloading_since: float | None = None  # cancel thread only
        self._grace_over = False  # engine thread: the in-flight requests were ended for the unload
        self._next_ready_poll = 0.0  # cancel thread only
        self._last_stats = 0.0
        # Per response thread: latency observations not yet made.
        self._pending_latencies: list[list[tuple[str, float]]] = [[] for _ in range(threads)]
        self._ended_in_step = 0  # engine thread: requests the last step ended, and when, and its duration
        self._step_end = 0.0
        self._step_seconds = 0.0
        self._fault_marker = os.environ.get(FAULT_MARKER_ENV, "")
        self._fault_ids: set[str] = set()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
        self._response_threads = [
            threading.Thread(target=self._response_loop, args=(shard,), name=f"pagedserve-responses-{shard}",
                             daemon=True) for shard in range(threads)]
        self._engine_thread = threading.Thread(target=self._engine_main, name="pagedserve-engine", daemon=True)
        self._cancel_thread = threading.Thread(target=self._cancel_loop, name="pagedserve-cancel", daemon=True)
        for thread in self._response_threads:
            thread.start()
        self._engine_thread.start()
        self._cancel_thread.start()
        with self._startup:
            self._startup.wait_for(lambda: self._started)
        if self._startup_error is not None:
            self._outbox.stop()
            self._watch.put(None)
            for thread in self._response_threads:
                thread.join()
            self._cancel_thread.join()
            raise pb_utils.TritonModelException(f"the pagedserve engine failed to start: {self._startup_error!r}")

    def execute(self, requests: list) -> None:
        """Validate each request and hand it to the engine thread; responses come from the response thread."""
        for request in requests:
            sender = request.get_response_sender()
            if self._closing:
                sender.send(error_response(ShuttingDownError(SHUTTING_DOWN)), flags=FINAL)
                continue
            try:
                inputs = parse_llm_request(request)
            except Exception as error:  # noqa: BLE001 - INVALID_ARG for bad input, INTERNAL otherwise
                sender.send(error_response(error), flags=FINAL)
                continue
            self._inbox.put(_InFlight(f"req-{next(self._ids)}", sender, inputs, time.monotonic()))
        return None

    def finalize(self) -> None:
        """End every in-flight request with an error response, then stop the threads."""
        self._closing = True
        self._inbox.put(_STOP)
        self._engine_thread.join(SHUTDOWN_TIMEOUT_SECONDS)
        self._watch.put(None)
        self._cancel_thread.join(SHUTDOWN_TIMEOUT_SECONDS)
        self._outbox.stop()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_SECONDS
        for thread in self._response_threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ---- engine thread -------------------------------------------------------------------------

    def _engine_main(self) -> None:
        """Load the engine, report back to initialize(), then run the loop until _STOP."""
        try:
            from pagedserve.backend.engine.llm_engine import LLMEngine

            model = self._model_path
            if not model:
                from pagedserve.backend.worker.default_model import ensure_default_model

                model = str(ensure_default_model())
            self._engine = LLMEngine.from_pretrained(model, **self._engine_kwargs)
            if self._fault_marker:
                self._engine.fault_injector = self._inject_fault
        except BaseException as error:  # noqa: BLE001 - handed to initialize(), which raises it
            self._startup_error = error
        with self._startup:
            self._started = True
            self._startup.notify_all()
        if self._startup_error is None:
            self._engine_loop()

    def _engine_loop(self) -> None:
        engine = self._engine
        active: dict[str, _InFlight] = {}
        while True:
            busy = engine.has_unfinished_requests()
            if not busy:
                self._outbox.put(("stats", engine.get_stats()))
            # Idle: block until a request (or a cancellation) arrives, so a new request's first step starts
            # as soon as execute() hands it over.
            items = self._drain_inbox(block=not busy)
            if self._ended_in_step:
                items = self._await_replacements(items)
            for item in items:
                if item is _STOP:
                    self._end_all(active)
                    return
                if item is _UNLOADING:
                    self._grace_over = True
                    self._end_all(active)
                elif isinstance(item, _Cancel):
                    self._abort(item.request_id, active)
                else:
                    self._add(item, active)
            if engine.has_unfinished_requests():
                self._step(active)

    def _inject_fault(self, sched: Any) -> None:
        """The FAULT_MARKER_ENV test hook: raise once for each marked request this step schedules."""
        marked = {s.request.group_id or s.request.request_id for s in sched.scheduled} & self._fault_ids
        if marked:
            self._fault_ids -= marked
            raise RuntimeError(f"injected fault ({FAULT_MARKER_ENV}) for {sorted(marked)}")

    def _drain_inbox(self, block: bool) -> list:
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items
            if items[-1] is _STOP:
                return items

    def _await_replacements(self, items: list) -> list:
        """The admission window (ADMISSION_WINDOW_MS above): after a step that ended N requests, wait until N new
        ones are in `items` or the window since that step's end is over."""
        wanted = self._ended_in_step - sum(isinstance(item, _InFlight) for item in items)
        self._ended_in_step = 0
        deadline = self._step_end + min(self._admission_window, self._admission_fraction * self._step_seconds)
        while wanted > 0 and _STOP not in items:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = self._inbox.get(timeout=remaining)
            except queue.Empty:
                break
            items.append(item)
            wanted -= isinstance(item, _InFlight)
        return items

    def _add(self, request: _InFlight, active: dict[str, _InFlight]) -> None:
        self._outbox.assign(request)
        if self._grace_over:
            # execute() passed it just before the cancel thread set _closing: end it as the others were.
            self._outbox.put_for(request, ("error", request, ShuttingDownError(SHUTTING_DOWN)))
            return
        inputs = request.inputs
        try:
            self._engine.add_request(request.request_id, inputs.prompt, inputs.params,
                                     prompt_token_ids=inputs.prompt_token_ids,
                                     add_special_tokens=inputs.add_special_tokens)
        except Exception as error:  # noqa: BLE001 - every failure becomes this request's error response
            self._outbox.put_for(request, ("error", request, error))
            return
        active[request.request_id] = request
        self._watch.put(request)
        if self._fault_marker and inputs.prompt and self._fault_marker in inputs.prompt:
            self._fault_ids.add(request.request_id)

    def _abort(self, request_id: str, active: dict[str, _InFlight]) -> None:
        """Abort a request the client cancelled, unless it already ended."""
        request = active.pop(request_id, None)
        if request is not None:
            self._engine.abort_request(request_id)
            self._outbox.put_for(request, ("cancelled", request))

    def _step(self, active: dict[str, _InFlight]) -> None:
        """Run one engine step and queue its outputs, metrics and responses in the order they should go out."""
        started = time.monotonic()
        try:
            outputs = self._engine.step()
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
            pb_utils.Logger.log_error(f"pagedserve engine step failed: {error!r}")
            self._outbox.put(("step_failure",))
            for request_id, request in active.items():
                self._engine.abort_request(request_id)
                self._outbox.put_for(request, ("error", request, RuntimeError(f"engine step failed: {error}")))
            active.clear()
            return
        failed = [output for output in outputs if output.error]
        if failed:
            pb_utils.Logger.log_error(f"pagedserve engine step failed ({failed[0].error}); "
                                      f"ended {len(failed)} request(s) with an error")
            self._outbox.put(("step_failure",))
        now = time.monotonic()
        later, finals = [], []
        any_first = False
        for output in outputs:
            request = active.get(output.request_id)
            if request is None:
                continue  # cancelled meanwhile
            if output.finished:
                del active[output.request_id]
                finals.append(("output", request, output, now))
            elif _first_tokens(output):
                # A first token goes out before the step's other tokens: its request's client is waiting for
                # the first sign of life, and behind 31 other sends it would wait ~10 ms more.
                self._outbox.put_for(request, ("output", request, output, now))
                any_first = True
            else:
                later.append(("output", request, output, now))
        firsts_sent = self._outbox.marker("sent") if any_first else None
        for item in later:
            self._outbox.put_for(item[1], item)
        # Metrics after the tokens that carry on (they need not wait for the metric round trips) and before
        # the final responses: a client that got its last response then reads /metrics sees this step.
        if now - self._last_stats >= STATS_INTERVAL_SECONDS or any(map(_starts_or_ends, outputs)):
            self._outbox.put(("stats", self._engine.get_stats()))
            self._last_stats = now
        if finals and len(self._outbox.queues) > 1:
            self._outbox.marker("fence")  # the other threads' finals wait for thread 0's metrics
        for item in finals:
            self._outbox.put_for(item[1], item)
        self._ended_in_step, self._step_end, self._step_seconds = len(finals), now, now - started
        if firsts_sent is not None:
            firsts_sent.wait(min(FIRST_TOKEN_WAIT_SECONDS, FIRST_TOKEN_WAIT_STEP_FRACTION * self._step_seconds))

    def _end_all(self, active: dict[str, _InFlight]) -> None:
        """End every running and queued request with an error: the model is shutting down."""
        error = ShuttingDownError(SHUTTING_DOWN)
        pending = list(active.values())
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _InFlight):
                pending.append(item)
            elif item is _STOP:
                self._inbox.put(_STOP)  # for the loop, which ends after this
                break
        for request in pending:
            if request.request_id in active:
                self._engine.abort_request(request.request_id)
            self._outbox.put_for(request, ("error", request, error))
        active.clear()

    # ---- cancel thread -------------------------------------------------------------------------

    def _cancel_poll_seconds(self, in_flight: int) -> float:
        """How long until the next round of is_cancelled() polls (CANCEL_POLLS_PER_SECOND above)."""
        step = min(self._step_seconds, CANCEL_POLL_MAX_STEP_SECONDS)
        return max(CANCEL_POLL_SECONDS, step, in_flight / CANCEL_POLLS_PER_SECOND)

    def _cancel_loop(self) -> None:
        """Ask each open request, at most once per step, whether its client cancelled it; tell the engine."""
        watched: list[_InFlight] = []
        next_poll = 0.0
        while True:
            timeout = max(0.0, next_poll - time.monotonic()) if watched else None
            try:
                items = [self._watch.get(timeout=timeout)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self._watch.get_nowait())
                except queue.Empty:
                    break
            if None in items:
                return
            if items and not watched:
                next_poll = time.monotonic() + self._cancel_poll_seconds(len(items))
            watched.extend(items)
            if time.monotonic() < next_poll:
                continue
            watched = [request for request in watched if not request.closed and not request.cancel_reported]
            for request in watched:
                try:
                    cancelled = self._is_cancelled(request)
                except Exception as error:  # noqa: BLE001 - one broken sender must not end the cancel thread
                    pb_utils.Logger.log_warn(f"pagedserve: is_cancelled() failed for {request.request_id} "
                                             f"({error!r}); it is not asked again")
                    request.cancel_reported = True
                    continue
                if cancelled:
                    request.cancel_reported = True
                    self._inbox.put(_Cancel(request.request_id))
            if watched:
                self._watch_unloading()
            next_poll = time.monotonic() + self._cancel_poll_seconds(len(watched))

    def _watch_unloading(self) -> None:
        """While requests are in flight: once the model stops being ready (the server is stopping or the
        model is being unloaded), refuse new requests; after the grace period, have the engine end the rest."""
        now = time.monotonic()
        if self._unloading_since is None:
            if now < self._next_ready_poll:
                return
            self._next_ready_poll = now + READY_POLL_SECONDS
            if self._model_ready():
                return
            self._unloading_since = now
            self._closing = True
            pb_utils.Logger.log_info(f"pagedserve: the {self._model_name} model is being unloaded; in-flight "
                                     f"requests have {self._shutdown_grace:g} s to finish")
        if now - self._unloading_since >= self._shutdown_grace:
            self._unloading_since = float("inf")  # reported once
            self._inbox.put(_UNLOADING)

    def _model_ready(self) -> bool:
        """Whether Triton still reports this model ready. A stopping server answers the check with a
        "Server not ready" error; any other failure counts as ready (no false alarm), logged."""
        try:
            return bool(pb_utils.is_model_ready(self._model_name, self._model_version))
        except Exception as error:  # noqa: BLE001
            if "not ready" in str(error).lower():
                return False
            pb_utils.Logger.log_warn(f"pagedserve: is_model_ready failed: {error!r}")
            return True

    @staticmethod
    def _is_cancelled(request: _InFlight) -> bool:
        with request.lock:
            return not request.closed and request.sender.is_cancelled()

    # ---- response thread -----------------------------------------------------------------------

    def _response_loop(self, shard: int) -> None:
        inbox = self._outbox.queues[shard]
        while True:
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                self._observe_pending(shard)  # nothing left to send: now the metric round trips
                item = inbox.get()
            if item is None:
                break
            try:
                self._handle(item)
            except Exception as error:  # noqa: BLE001 - one bad response must not stop the others
                pb_utils.Logger.log_error(f"pagedserve response thread: {error!r}")
                if item[0] == "output":
                    self._try_send_error(item[1], error)

    def _try_send_error(self, request: _InFlight, error: BaseException) -> None:
        """End a request whose response could not be built; the client may already be gone."""
        try:
            self._send_error(request, error)
        except Exception as send_error:  # noqa: BLE001
            pb_utils.Logger.log_error(f"pagedserve could not end request {request.request_id}: {send_error!r}")

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "stats":
            self._metrics.update(item[1])
        elif kind == "sent":
            item[1].arrive()
        elif kind == "fence":
            item[1].arrive()
            if not item[1].wait(FENCE_TIMEOUT_SECONDS):
                pb_utils.Logger.log_warn("pagedserve response thread: a fence timed out; sending on")
        elif kind == "step_failure":
            self._metrics.count_step_failure()
        elif kind == "output":
            self._send_output(*item[1:])
        elif kind == "error":
            self._send_error(item[1], item[2])
        elif kind == "cancelled":
            self._send_final(item[1], pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                "the request was cancelled", pb_utils.TritonError.CANCELLED)))

    @staticmethod
    def _send_final(request: _InFlight, response: Any) -> None:
        """Send a request's last response; the cancel thread stops asking about it first."""
        with request.lock:
            request.closed = True
        request.sender.send(response, flags=FINAL)

    def _send_error(self, request: _InFlight, error: BaseException) -> None:
        self._send_final(request, error_response(error))

    def _send_output(self, request: _InFlight, output: Any, now: float) -> None:
        num_new = sum(len(c.token_ids_delta) for c in output.outputs)
        latency = None
        if num_new:
            if request.last_token_time is None:
                latency = ("ttft", now - request.arrival)
            else:
                latency = ("itl", now - request.last_token_time)
            request.last_token_time = now
        if not output.finished and not output.error:
            # Each observation is a round trip to the server that holds the GIL: they wait until every
            # queued response has gone out.
            if request.inputs.stream and num_new:
                tensors = self._output_tensors(request, output)
                request.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=0)
            if latency:
                self._pending_latencies[request.shard].append(latency)
            return
        # The last response goes out after its observations, so /metrics already counts the request.
        self._observe_pending(request.shard)
        if latency:
            self._metrics.observe(*latency)
        if output.finished:
            self._metrics.observe("e2e", now - request.arrival)
        if output.error:
            self._send_error(request, RuntimeError(output.error))
            return
        self._send_final(request, pb_utils.InferenceResponse(output_tensors=self._output_tensors(request, output)))

    def _observe_pending(self, shard: int) -> None:
        """Make the latency observations the streamed responses of this response thread put off (one metric
        round trip each)."""
        pending, self._pending_latencies[shard] = self._pending_latencies[shard], []
        try:
            for latency in pending:
                self._metrics.observe(*latency)
        except Exception as error:  # noqa: BLE001 - a failed observation must not stop the responses
            pb_utils.Logger.log_error(f"pagedserve response thread: a latency observation failed: {error!r}")

    def _output_tensors(self, request: _InFlight, output: Any) -> list:
        inputs = request.inputs
        completions = output.outputs
        if inputs.stream:
            texts = [c.text_delta for c in completions]
        else:
            echo = "" if inputs.exclude_input_in_output else self._prompt_text(output)
            texts = [echo + c.text for c in completions]
        tensors = [string_tensor("text_output", texts)]
        ensemble = inputs.from_ensemble
        if ensemble:
            tensors += self._ensemble_tensors(request, output)
        if inputs.return_finish_reason or ensemble:
            tensors.append(string_tensor("finish_reason", [c.finish_reason or "" for c in completions]))
        if inputs.return_cumulative_logprob or ensemble:
            values = [c.cumulative_logprob or 0.0 for c in completions]
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.asarray(values, dtype=np.float32)))
        if inputs.return_logprobs or ensemble:
            entries = [json.dumps(self._logprob_entries(c, inputs), ensure_ascii=False) for c in completions]
            tensors.append(string_tensor("logprobs", entries))
        if inputs.return_num_input_tokens:
            tensors.append(pb_utils.Tensor("num_input_tokens",
                                           np.asarray([len(output.prompt_token_ids)], dtype=np.int32)))
        if inputs.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens",
                                           np.asarray([len(c.token_ids) for c in completions], dtype=np.int32)))
        if inputs.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            # Complete once the prompt is prefilled, which is before the request's first response.
            request.prompt_logprobs_sent = True
            entries = self._prompt_logprob_entries(output, inputs.params.prompt_logprobs)
            tensors.append(string_tensor("prompt_logprobs", [json.dumps(entries, ensure_ascii=False)]))
        return tensors

    def _prompt_text(self, output: Any) -> str:
        if output.prompt is not None:
            return output.prompt
        return self._engine.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=True)

    def _ensemble_tensors(self, request: _InFlight, output: Any) -> list:
        """`output_ids` plus the preceding ids and read offset postprocessing needs to decode statelessly."""
        completion = output.outputs[0]
        inputs = request.inputs
        prompt_ids = inputs.prompt_token_ids
        generated = list(completion.token_ids_delta if inputs.stream else completion.token_ids)
        if (completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
                and not inputs.params.include_stop_str_in_output and generated):
            generated.pop()  # the eos or stop token (end_id) that ended it: not in the text, as in text_output
        if not request.token_ids:
            request.token_ids = list(prompt_ids)
            request.prefix_offset, request.read_offset = initial_offsets(len(prompt_ids))
        if inputs.stream:
            new_ids = generated
            before = len(request.token_ids)
            request.token_ids.extend(new_ids)
            prefix_ids = request.token_ids[request.prefix_offset:before]
            read_offset = request.read_offset - request.prefix_offset
            _, request.prefix_offset, request.read_offset = detokenize_incrementally(
                self._engine.tokenizer, request.token_ids, request.prefix_offset, request.read_offset,
                inputs.params.skip_special_tokens,
            )
            output_ids = new_ids
        elif inputs.exclude_input_in_output:
            prefix_ids = prompt_ids[request.prefix_offset:]
            read_offset = len(prefix_ids)
            output_ids = generated
        else:
            prefix_ids, read_offset, output_ids = [], 0, list(prompt_ids) + generated
        return [
            pb_utils.Tensor("output_ids", np.asarray(output_ids, dtype=np.int32)),
            pb_utils.Tensor("prefix_ids", np.asarray(prefix_ids, dtype=np.int32)),
            pb_utils.Tensor("read_offset", np.asarray([read_offset], dtype=np.int32)),
        ]

    def _logprob_entries(self, completion: Any, inputs: LLMRequestInputs) -> list[dict]:
        """The logprobs JSON of this response's tokens: all of them, or the new ones when streaming."""
        if not completion.logprobs:
            return []
        count = len(completion.token_ids_delta) if inputs.stream else len(completion.token_ids)
        token_ids = completion.token_ids[len(completion.token_ids) - count:]
        per_token = completion.logprobs[len(completion.logprobs) - count:] if count else []
        return [self._token_entry(token_id, candidates, inputs.params.logprobs or 0)
                for token_id, candidates in zip(token_ids, per_token, strict=True)]

    def _prompt_logprob_entries(self, output: Any, top_n: int) -> list[dict]:
        """The `prompt_logprobs` JSON: one entry per prompt token; the first, which nothing precedes, has
        null `logprob` and `top_logprobs`."""
        entries = []
        for token_id, candidates in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True):
            if candidates is None:
                entries.append({"token_id": token_id, "token": self._engine.tokenizer.decode([token_id]),
                                "logprob": None, "top_logprobs": None})
            else:
                entries.append(self._token_entry(token_id, candidates, top_n))
        return entries

    def _token_entry(self, token_id: int, candidates: dict[int, float], top_n: int) -> dict:
        decode = self._engine.tokenizer.decode
        ranked = sorted(candidates.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        return {
            "token_id": token_id,
            "token": decode([token_id]),
            "logprob": candidates.get(token_id, float("nan")),
            "top_logprobs": [{"token_id": t, "token": decode([t]), "logprob": lp} for t, lp in ranked],
        }
