"""The llm model's cancel watcher with fake senders: a client's cancellation reaches the engine loop (and from
there the engine's abort), requests that ended are not asked again, a broken sender is given up on, and a model
that stops being ready is closed and, after the grace period, unloaded."""

from __future__ import annotations

import queue
import time

import pytest

from pagedserve.backend.triton.cancel_watcher import CancelWatcher
from pagedserve.backend.triton.messages import Cancel, Unloading
from pagedserve.backend.triton.protocols import FINAL
from tests.support.triton_glue import JOIN_SECONDS, FakeSender, Glue, ListLog, ScriptedEngine, in_flight

SETTLE_SECONDS = 0.3  # several poll rounds (CANCEL_POLL_SECONDS is 0.05)


class Watching:
    """A started CancelWatcher over a fresh inbox; `stop()` ends its thread."""

    def __init__(self, ready=lambda name, version: True, grace: float = 0.0, inbox=None):
        self.inbox = inbox if inbox is not None else queue.SimpleQueue()
        self.log = ListLog()
        self.ready_calls: list[tuple[str, str]] = []

        def is_model_ready(name: str, version: str) -> bool:
            self.ready_calls.append((name, version))
            return ready(name, version)

        self.watcher = CancelWatcher("llm", "1", grace, self.inbox, lambda: 0.0, is_model_ready, self.log)
        self.watcher.thread.start()

    def stop(self) -> None:
        self.watcher.watch.put(None)
        self.watcher.thread.join(JOIN_SECONDS)
        assert not self.watcher.thread.is_alive()


@pytest.fixture
def watching():
    running = []

    def start(**kwargs) -> Watching:
        running.append(Watching(**kwargs))
        return running[-1]

    yield start
    for watcher in running:
        watcher.stop()


def test_a_cancelled_request_is_reported_once_to_the_engine_loop(watching):
    w = watching()
    sender = FakeSender(is_cancelled=lambda: sender.polls >= 3)
    w.watcher.watch.put(in_flight("a", sender))
    assert w.inbox.get(timeout=JOIN_SECONDS) == Cancel("a")
    time.sleep(SETTLE_SECONDS)
    assert sender.polls == 3 and w.inbox.empty()


def test_a_request_that_ended_is_not_asked_again(watching):
    w = watching()
    ended, open_ = FakeSender(), FakeSender()
    closed = in_flight("a", ended)
    closed.closed = True  # its FINAL response went out: the server freed its response factory
    w.watcher.watch.put(closed)
    w.watcher.watch.put(in_flight("b", open_))
    time.sleep(SETTLE_SECONDS)
    assert ended.polls == 0 and open_.polls >= 2 and w.inbox.empty()


def test_a_sender_whose_is_cancelled_fails_is_logged_and_not_asked_again(watching):
    w = watching()

    def broken() -> bool:
        raise RuntimeError("stub gone")

    sender = FakeSender(is_cancelled=broken)
    w.watcher.watch.put(in_flight("a", sender))
    time.sleep(SETTLE_SECONDS)
    assert sender.polls == 1 and w.inbox.empty()
    assert w.log.lines == [("warn", "pagedserve: is_cancelled() failed for a (RuntimeError('stub gone')); it is "
                                    "not asked again")]


def test_a_model_no_longer_ready_closes_then_unloads_after_the_grace(watching):
    grace = 0.5
    w = watching(ready=lambda name, version: False, grace=grace)
    w.watcher.watch.put(in_flight("a", FakeSender()))
    deadline = time.monotonic() + JOIN_SECONDS
    while not w.watcher.closing:  # new requests are refused from here on
        assert time.monotonic() < deadline, "the watcher never noticed the model not ready"
        time.sleep(0.01)
    closed_at = time.monotonic()
    assert w.inbox.empty()  # the running request has its grace
    assert w.inbox.get(timeout=JOIN_SECONDS) == Unloading()
    assert time.monotonic() - closed_at >= grace - 0.05
    assert w.ready_calls[0] == ("llm", "1")


def test_a_ready_model_is_not_unloaded(watching):
    w = watching()
    w.watcher.watch.put(in_flight("a", FakeSender()))
    time.sleep(SETTLE_SECONDS)
    assert not w.watcher.closing and w.inbox.empty() and w.ready_calls


def test_a_clients_cancellation_reaches_the_engines_abort_and_ends_the_request_cancelled():
    engine = ScriptedEngine()
    engine.step_seconds = 0.002
    log = ListLog()
    # Wired as llm_model.py wires them: the watcher first, told the engine loop's inbox once the loop exists.
    watcher = CancelWatcher("llm", "1", 5.0, None, lambda: glue.loop.step_seconds, lambda name, version: True, log)
    glue = Glue(engine, watch=watcher.watch)
    watcher.engine_inbox = glue.loop.inbox
    sender = FakeSender(is_cancelled=lambda: len(sender.sends) >= 2)
    watcher.thread.start()
    glue.submit(in_flight("a", sender, max_tokens=100_000))
    glue.run()
    watcher.watch.put(None)
    watcher.thread.join(JOIN_SECONDS)
    *tokens, last = sender.sends
    assert last == (("cancelled",), FINAL)
    assert tokens == [(("output", [f"t{100 + i}"]), 0) for i in range(len(tokens))] and len(tokens) >= 2
    assert [call for call in engine.calls if call[0] == "abort"] == [("abort", "a")]

