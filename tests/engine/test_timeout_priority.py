"""LLMEngine request timeouts (a running or waiting request ends with a TIMEOUT error and frees its blocks,
the others go on) and the priority policy through add_request."""

from __future__ import annotations

import math

import pytest

from pagedserve.backend.core.errors import ErrorKind, InvalidRequestError
from pagedserve.backend.engine import llm_engine
from pagedserve.backend.engine.llm_engine import LLMEngine
from tests.support.engines import cpu_engine, greedy, run_to_end

PROMPT = "The quick brown fox"
OTHER = "Once upon a time"


class FakeClock:
    """Stands in for the engine module's `time`: the tests move its monotonic clock by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(llm_engine, "time", fake)
    return fake


@pytest.fixture
def engine(tiny_llama_path) -> LLMEngine:
    return cpu_engine(tiny_llama_path, block_size=4, num_blocks=64, max_model_len=128)


def test_a_running_request_whose_timeout_passes_ends_with_a_timeout_error_and_frees_its_blocks(engine, clock):
    alone = engine.generate(OTHER, greedy(10))[0].outputs[0].token_ids
    engine.add_request("slow", PROMPT, greedy(40), arrival_time=clock.now, timeout=2.5)
    engine.add_request("other", OTHER, greedy(10), arrival_time=clock.now)
    for _ in range(3):
        engine.step()
    held = engine.get_stats().num_blocks - engine.get_stats().num_free_blocks
    clock.now += 2.5
    outs = {o.request_id: o for o in engine.step()}
    slow = outs["slow"]
    assert slow.finished and slow.outputs[0].finish_reason == "error"
    assert slow.error_kind is ErrorKind.TIMEOUT
    assert "timeout" in slow.error and "2.5 s" in slow.error
    assert len(slow.outputs[0].token_ids) == 3  # what it made before the deadline stays in its output
    stats = engine.get_stats()
    assert stats.num_blocks - stats.num_free_blocks < held  # its blocks are back in the pool
    final = run_to_end(engine)
    assert final["other"].outputs[0].token_ids == alone
    assert final["other"].error is None and final["other"].error_kind is None
    assert engine.get_stats().kv_cache_usage == 0.0


def test_a_waiting_request_whose_timeout_passes_ends_before_it_is_ever_scheduled(tiny_llama_path, clock):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=64, max_model_len=128, max_num_seqs=1)
    engine.add_request("running", PROMPT, greedy(8), arrival_time=clock.now)
    engine.step()
    engine.add_request("queued", OTHER, greedy(8), arrival_time=clock.now, timeout=1.0)
    engine.step()
    assert engine.get_stats().num_waiting == 1
    clock.now += 1.0
    outs = {o.request_id: o for o in engine.step()}
    queued = outs["queued"]
    assert queued.finished and queued.error_kind is ErrorKind.TIMEOUT
    assert queued.outputs[0].token_ids == [] and queued.outputs[0].finish_reason == "error"
    assert engine.get_stats().num_waiting == 0
    assert len(run_to_end(engine)["running"].outputs[0].token_ids) == 8


def test_a_timeout_counts_from_the_arrival_time(engine, clock):
    engine.add_request("late", PROMPT, greedy(8), arrival_time=clock.now - 5.0, timeout=5.0)
    outs = engine.step()
    assert [o.error_kind for o in outs] == [ErrorKind.TIMEOUT]
    assert not engine.has_unfinished_requests()


def test_a_request_that_ends_in_time_leaves_no_deadline_behind_for_its_id(engine, clock):
    engine.add_request("r", PROMPT, greedy(3), arrival_time=clock.now, timeout=10.0)
    assert run_to_end(engine)["r"].error is None
    engine.add_request("r", PROMPT, greedy(3), arrival_time=clock.now)  # the same id, no timeout
    clock.now += 20.0
    final = run_to_end(engine)["r"]
    assert final.error is None and len(final.outputs[0].token_ids) == 3


def test_a_failed_step_is_an_internal_error(engine):
    def fail(sched):
        raise RuntimeError("injected fault")

    engine.runner.execute = fail
    engine.add_request("doomed", PROMPT, greedy(4))
    (out,) = engine.step()
    assert out.error_kind is ErrorKind.INTERNAL and "injected fault" in out.error


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, True, "1"])
def test_a_bad_timeout_is_refused_naming_it(engine, timeout):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", PROMPT, greedy(), timeout=timeout)
    assert info.value.field == "timeout"
    assert not engine.has_unfinished_requests()


def test_the_priority_policy_serves_a_later_urgent_request_first(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=64, max_model_len=128, max_num_seqs=1,
                        scheduling_policy="priority")
    engine.add_request("first", PROMPT, greedy(4))
    engine.step()
    engine.add_request("normal", OTHER, greedy(4))
    engine.add_request("urgent", OTHER + " there", greedy(4), priority=-1)
    finish_order = []
    while engine.has_unfinished_requests():
        finish_order += [out.request_id for out in engine.step() if out.finished]
    # "urgent" preempts "first" (default priority 0) for the only sequence slot; then "first", which
    # arrived before "normal", resumes.
    assert finish_order == ["urgent", "first", "normal"]
    assert engine.get_stats().num_preemptions == 1


def test_a_bad_priority_is_refused_naming_it(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", PROMPT, greedy(), priority=1.5)
    assert info.value.field == "priority"
    assert not engine.has_unfinished_requests()
