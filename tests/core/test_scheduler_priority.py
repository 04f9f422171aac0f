"""The priority scheduling policy: lower `priority` first, arrival within a level, and a waiting request of
a higher priority takes the blocks (or the sequence slot) of running requests of a lower one."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.config import SchedulerConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.request import Request, RequestStatus


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50 + 1 for i in range(length)]


def first_scheduled_order(runner) -> list[str]:
    """Run to the end; the request ids in the order each was first scheduled."""
    order: list[str] = []
    for _ in range(10_000):
        if not runner.scheduler.has_unfinished_requests():
            return order
        for sched in runner.step().scheduled:
            if sched.request.request_id not in order:
                order.append(sched.request.request_id)
    raise AssertionError("requests still unfinished")


def priority_runner(runner_factory, **kwargs):
    return runner_factory(scheduling_policy="priority", **kwargs)


def test_waiting_requests_are_admitted_lowest_priority_value_first(runner_factory, alone):
    runner = priority_runner(runner_factory, max_num_seqs=1)
    wanted = {}
    for i, (request_id, priority) in enumerate([("b", 5), ("a", 0), ("c", 1), ("d", 1), ("e", -2)]):
        p = prompt(i, 5)
        runner.add(request_id, p, 3, priority=priority)
        wanted[request_id] = alone(p, 3)
    assert first_scheduled_order(runner) == ["e", "a", "c", "d", "b"]
    assert runner.outputs == wanted


def test_within_a_level_the_earlier_arrival_goes_first_then_the_earlier_request(runner_factory):
    runner = priority_runner(runner_factory, max_num_seqs=1)
    runner.add("late", prompt(1, 5), 2, priority=3, arrival_time=20.0)
    runner.add("early", prompt(2, 5), 2, priority=3, arrival_time=10.0)
    runner.add("early-too", prompt(3, 5), 2, priority=3, arrival_time=10.0)
    runner.add("urgent-but-last", prompt(4, 5), 2, priority=2, arrival_time=30.0)
    assert [r.request_id for r in runner.scheduler.waiting] == ["urgent-but-last", "early", "early-too", "late"]
    assert first_scheduled_order(runner) == ["urgent-but-last", "early", "early-too", "late"]


def test_the_default_fcfs_policy_ignores_priority(runner_factory):
    runner = runner_factory(max_num_seqs=1)
    for i, (request_id, priority) in enumerate([("b", 5), ("a", 0), ("e", -2)]):
        runner.add(request_id, prompt(i, 5), 3, priority=priority)
    assert first_scheduled_order(runner) == ["b", "a", "e"]


def test_a_higher_priority_arrival_preempts_a_lower_one_when_blocks_run_out(runner_factory, alone):
    runner = priority_runner(runner_factory, num_blocks=4, block_size=4, max_model_len=16)
    sched = runner.scheduler
    low = runner.add("low", prompt(1, 11), 4, priority=1)
    runner.step()
    runner.step()  # low holds 3 of the 4 blocks and is decoding
    high = runner.add("high", prompt(2, 7), 4, priority=0)  # needs 2 blocks
    out = runner.step()
    assert out.preempted_ids == ["low"]
    # low was scheduled for its decode in this very step: it leaves the step and gives its token back.
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    assert out.total_num_scheduled_tokens == 7
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert high.status == RequestStatus.RUNNING
    assert [r.request_id for r in sched.waiting] == ["low"]
    outputs = runner.run()
    assert outputs == {"low": alone(prompt(1, 11), 4), "high": alone(prompt(2, 7), 4)}
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.requests and sched.num_waiting == 0


def test_a_higher_priority_arrival_preempts_for_a_sequence_slot(runner_factory, alone):
    runner = priority_runner(runner_factory, max_num_seqs=1)
    runner.add("low", prompt(1, 5), 6, priority=2)
    runner.step()
    runner.add("high", prompt(2, 5), 3, priority=1)
    out = runner.step()
    assert out.preempted_ids == ["low"]
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    assert runner.run() == {"low": alone(prompt(1, 5), 6), "high": alone(prompt(2, 5), 3)}


@pytest.mark.parametrize("priority", [1, 2])
def test_an_arrival_of_the_same_or_a_lower_priority_never_preempts(runner_factory, priority):
    runner = priority_runner(runner_factory, num_blocks=4, block_size=4, max_model_len=16)
    runner.add("running", prompt(1, 11), 4, priority=1)
    runner.step()
    runner.add("waiting", prompt(2, 7), 4, priority=priority)
    while runner.scheduler.get_request("running") is not None:
        out = runner.step()
        assert out.preempted_ids == []
        assert runner.scheduler.get_request("waiting").status == RequestStatus.WAITING
    assert set(runner.run()) == {"running", "waiting"}


def test_when_a_running_request_needs_a_block_the_lowest_priority_gives_way_not_the_newest(runner_factory):
    runner = priority_runner(runner_factory, num_blocks=4, block_size=4, max_num_batched_tokens=16,
                             max_model_len=16)
    runner.add("low", prompt(1, 7), 8, priority=5)
    runner.step()
    runner.add("high", prompt(2, 7), 8, priority=0)  # newer, and admitted into the two free blocks
    runner.step()
    assert runner.scheduler.block_manager.num_free_blocks == 0
    preempted = []
    while not preempted:
        preempted = runner.step().preempted_ids
    assert preempted == ["low"]  # under FCFS the newest ("high") would have given way
    assert runner.scheduler.get_request("high").status == RequestStatus.RUNNING


def test_preemption_goes_from_the_lowest_priority_up_and_stops_at_the_arrivals_level(runner_factory, alone):
    runner = priority_runner(runner_factory, num_blocks=6, block_size=4, max_model_len=24)
    wanted = {}
    for i, (request_id, priority) in enumerate([("p1", 1), ("p3", 3), ("p2", 2)]):
        p = prompt(i, 6)
        runner.add(request_id, p, 4, priority=priority)
        wanted[request_id] = alone(p, 4)
    runner.step()  # all three hold two blocks each, room for their next token: the pool is full
    assert runner.scheduler.block_manager.num_free_blocks == 0
    runner.add("p2-new", prompt(9, 14), 2, priority=2)  # needs four blocks
    wanted["p2-new"] = alone(prompt(9, 14), 2)
    out = runner.step()
    # p3 gives way first; p2 is of the arrival's own level and p1 above it, so four blocks are not found.
    assert out.preempted_ids == ["p3"]
    assert runner.run() == wanted
    assert runner.scheduler.block_manager.num_free_blocks == 6


def test_forked_sequences_keep_their_parents_priority_and_arrival(runner_factory):
    runner = priority_runner(runner_factory)
    parent = runner.add("parent", prompt(1, 6), 4, priority=-7, arrival_time=3.5)
    runner.step()
    child = runner.fork("parent", "child", next_tok=9)
    assert (child.priority, child.arrival_time) == (parent.priority, parent.arrival_time)
    assert [r.request_id for r in runner.scheduler.running] == ["parent", "child"]


def test_requests_aborted_while_queued_by_priority_do_not_pile_up(runner_factory):
    runner = priority_runner(runner_factory, num_blocks=4, block_size=4, max_model_len=16)
    runner.add("big", prompt(1, 12), 4, priority=0)
    runner.step()
    runner.add("head", prompt(2, 12), 4, priority=0)  # cannot be admitted while "big" runs
    for i in range(1000):
        runner.add(f"gone{i}", prompt(3, 4), 2, priority=i % 3)
        runner.scheduler.abort(f"gone{i}")
    assert runner.scheduler.num_waiting == 1
    assert len(runner.scheduler.waiting) < 100
    assert set(runner.run()) == {"big", "head"}


@pytest.mark.parametrize("priority", [True, 1.0, "1", 2**63, -(2**63) - 1])
def test_a_bad_priority_is_refused_naming_it(priority):
    with pytest.raises(InvalidRequestError) as info:
        Request("r", [1, 2], priority=priority)
    assert info.value.field == "priority"


def test_an_unknown_scheduling_policy_is_refused_naming_it():
    with pytest.raises(InvalidRequestError) as info:
        SchedulerConfig(scheduling_policy="lifo")
    assert info.value.field == "scheduling_policy"
    assert "fcfs" in str(info.value) and "priority" in str(info.value)
