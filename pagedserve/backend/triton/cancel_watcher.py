"""The cancel thread of the llm model: asks each open request, at most once per step, whether its client
cancelled it, and notices the model being unloaded. is_cancelled() and is_model_ready() are round trips to
the server process, made here so the engine thread never waits on them."""

from __future__ import annotations

import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from pagedserve.backend.triton.messages import Cancel, InboxItem, InFlight, Unloading
from pagedserve.backend.triton.protocols import Log, PythonLog
from pagedserve.backend.triton.settings import (
    CANCEL_POLL_MAX_STEP_SECONDS,
    CANCEL_POLL_SECONDS,
    CANCEL_POLLS_PER_SECOND,
    HEALTH_URL_ENV,
    READY_POLL_SECONDS,
)

READY_CHECK_TIMEOUT_SECONDS = 2.0  # a slow answer counts as ready: no false alarm


class CancelWatcher:
    """Owns the watched requests and the unload clock; tells the engine loop through its inbox.

    `closing` is read by execute(): once the model stops being ready, new requests are refused.
    `is_model_ready(name, version)` asks the server (pb_utils.is_model_ready in the model).
    """

    def __init__(self, model_name: str, model_version: str, shutdown_grace: float,
                 engine_inbox: queue.SimpleQueue[InboxItem] | None, step_seconds: Callable[[], float],
                 is_model_ready: Callable[[str, str], bool], log: Log | None = None):
        self.watch: queue.SimpleQueue[InFlight | None] = queue.SimpleQueue()  # None stops the thread
        self.closing = False
        self._model_name, self._model_version = model_name, model_version
        self._shutdown_grace = shutdown_grace
        self.engine_inbox = engine_inbox
        self._step_seconds = step_seconds
        self._is_model_ready = is_model_ready
        self._log = log or PythonLog()
        self._unloading_since: float | None = None
        self._ready_url = os.environ.get(HEALTH_URL_ENV, "")
        self._next_ready_poll = 0.0
        self.thread = threading.Thread(target=self._run, name="pagedserve-cancel", daemon=True)

    def _poll_seconds(self, in_flight: int) -> float:
        """How long until the next round of is_cancelled() polls."""
        step = min(self._step_seconds(), CANCEL_POLL_MAX_STEP_SECONDS)
        return max(CANCEL_POLL_SECONDS, step, in_flight / CANCEL_POLLS_PER_SECOND)

    def _take(self, timeout: float | None) -> list[InFlight | None]:
        """What the engine loop sent: wait up to `timeout` for the first item, then take the rest."""
        try:
            items = [self.watch.get(timeout=timeout)]
        except queue.Empty:
            items = []
        while True:
            try:
                items.append(self.watch.get_nowait())
            except queue.Empty:
                return items

    def _run(self) -> None:
        watched: list[InFlight] = []
        next_poll = 0.0
        while True:
            items = self._take(max(0.0, next_poll - time.monotonic()) if watched else None)
            if None in items:
                return
            if items and not watched:
                next_poll = time.monotonic() + self._poll_seconds(len(items))
            watched.extend(items)
            if time.monotonic() < next_poll:
                continue
            watched = [request for request in watched if not request.closed and not request.cancel_reported]
            for request in watched:
                self._poll(request)
            if watched:
                self._watch_unloading()
            next_poll = time.monotonic() + self._poll_seconds(len(watched))

    def _poll(self, request: InFlight) -> None:
        """Ask once whether the client cancelled `request`; a failing sender is not asked again."""
        try:
            with request.lock:
                cancelled = not request.closed and request.sender.is_cancelled()
        except Exception as error:  # noqa: BLE001 - one broken sender must not end the cancel thread
            self._log.log_warn(f"pagedserve: is_cancelled() failed for {request.request_id} "
                                     f"({error!r}); it is not asked again")
            request.cancel_reported = True
            return
        if cancelled:
            request.cancel_reported = True
            self.engine_inbox.put(Cancel(request.request_id))

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
            self.closing = True
            self._log.log_info(f"pagedserve: the {self._model_name} model is being unloaded; in-flight "
                                     f"requests have {self._shutdown_grace:g} s to finish")
        if now - self._unloading_since >= self._shutdown_grace:
            self._unloading_since = float("inf")  # reported once
            self.engine_inbox.put(Unloading())

    def _model_ready(self) -> bool:
        """Whether Triton still reports this model ready. A stopping server is seen on its HTTP readiness
        URL when the launcher gave one, before is_model_ready is asked; without it, is_model_ready answers
        a stopping server with a "Server not ready" error. Any other failure counts as ready, logged."""
        if self._ready_url and not _server_ready(self._ready_url):
            return False
        try:
            return bool(self._is_model_ready(self._model_name, self._model_version))
        except Exception as error:  # noqa: BLE001
            if "not ready" in str(error).lower():
                return False
            self._log.log_warn(f"pagedserve: is_model_ready failed: {error!r}")
            return True


def _server_ready(url: str) -> bool:
    """tritonserver's /v2/health/ready: False once it answers otherwise (a stopping server) or is gone."""
    try:
        with urllib.request.urlopen(url, timeout=READY_CHECK_TIMEOUT_SECONDS) as answer:
            return answer.status == 200
    except urllib.error.HTTPError:
        return False
    except (urllib.error.URLError, OSError) as error:
        return not isinstance(getattr(error, "reason", error), ConnectionRefusedError)
