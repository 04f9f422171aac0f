"""Scheduler behaviour driven by a fake model over a fake KV cache (see conftest.py)."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.errors import InvalidRequestError, ServerBusyError
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50 + 1 for i in range(length)]


def test_every_request_completes_with_the_tokens_it_would_make_alone(runner_factory, alone):
    runner = runner_factory(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    wanted = {}
    for i in range(12):
        p, m = prompt(i, 5 + 3 * i), 4 + i
        runner.add(f"r{i}", p, m)
        wanted[f"r{i}"] = alone(p, m)
    assert runner.run() == wanted
    assert runner.scheduler.kv_cache_usage() == 0.0
    assert runner.scheduler.num_preemptions == 0


def test_preemption_under_a_small_pool_loses_and_changes_nothing(runner_factory, alone):
    runner = runner_factory(num_blocks=11, block_size=4, max_num_batched_tokens=16, max_model_len=44)
    wanted = {}
    for i in range(10):
        p, m = prompt(i, 6 + i), 20
        runner.add(f"r{i}", p, m)
        wanted[f"r{i}"] = alone(p, m)
    outputs = runner.run()
    assert runner.scheduler.num_preemptions > 0
    assert outputs == wanted


def test_preempted_request_rejoins_the_front_of_the_queue_keeping_its_tokens(runner_factory):
    runner = runner_factory(num_blocks=4, block_size=4, max_num_batched_tokens=16, max_model_len=16)
    sched = runner.scheduler
    old = runner.add("old", prompt(1, 7), 8)
    new = runner.add("new", prompt(2, 7), 8)
    runner.add("late", prompt(3, 3), 4)
    runner.step()  # both prefills: 2 blocks each, the pool is full
    assert sched.block_manager.num_free_blocks == 0
    out = runner.step()  # both decode into their partial blocks
    assert out.preempted_ids == []
    out = runner.step()  # old needs a third block: the newest running request gives way
    assert out.preempted_ids == ["new"]
    assert [s.request.request_id for s in out.scheduled] == ["old"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_output_tokens == 2
    assert [r.request_id for r in sched.waiting] == ["new", "late"]
    assert sched.get_request("old") is old and sched.num_waiting == 2


def test_a_waiting_request_never_preempts_a_running_one(runner_factory):
    runner = runner_factory(num_blocks=4, block_size=4, max_model_len=16)
    runner.add("a", prompt(1, 12), 4)
    runner.step()
    runner.add("b", prompt(2, 8), 2)
    for _ in range(3):
        out = runner.step()
        assert out.preempted_ids == []
        assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert runner.scheduler.get_request("b").status == RequestStatus.WAITING


def test_one_budget_mixes_decodes_and_a_chunked_prefill(runner_factory):
    runner = runner_factory(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    runner.add("a", prompt(1, 5), 10)
    out = runner.step()
    assert [(s.request.request_id, s.num_scheduled_tokens, s.sample) for s in out.scheduled] == [
        ("a", 5, True)
    ]
    runner.add("b", prompt(2, 20), 3)
    out = runner.step()
    assert [
        (s.request.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.sample) for s in out.scheduled
    ] == [
        ("a", 5, 1, True),
        ("b", 0, 7, False),
    ]
    assert out.total_num_scheduled_tokens == 8
    out = runner.step()
    assert [(s.request.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("a", 6, 1),
        ("b", 7, 7),
    ]
    out = runner.step()
    assert [(s.request.request_id, s.num_scheduled_tokens, s.sample) for s in out.scheduled] == [
        ("a", 1, True),
        ("b", 6, True),
    ]


def test_max_num_seqs_caps_the_running_set(runner_factory):
    runner = runner_factory(num_blocks=64, max_num_seqs=2)
    for i in range(3):
        runner.add(f"r{i}", prompt(i, 4), 5)
    out = runner.step()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert runner.scheduler.num_running == 2 and runner.scheduler.num_waiting == 1


def test_second_request_reuses_a_three_block_prefix(runner_factory):
    runner = runner_factory(num_blocks=32, block_size=4)
    shared = prompt(1, 12)
    runner.add("a", shared + [5, 6], 2)
    runner.run()
    b = runner.add("b", shared + [7, 8, 9], 2)
    out = runner.step()
    (sched_b,) = out.scheduled
    assert sched_b.num_computed_tokens == 12 and sched_b.num_scheduled_tokens == 3
    assert sched_b.block_ids[:3] == [0, 1, 2]
    assert b.num_cached_tokens == 12
    assert runner.scheduler.prefix_cache_hits == 12
    assert runner.scheduler.prefix_cache_queries == 14 + 15


def test_request_differing_in_the_last_token_of_a_block_misses_that_block(runner_factory):
    runner = runner_factory(num_blocks=32, block_size=4)
    shared = prompt(1, 12)
    runner.add("a", shared + [5], 1)
    runner.run()
    other = list(shared)
    other[11] += 1
    runner.add("b", other + [5], 1)
    (sched_b,) = runner.step().scheduled
    assert sched_b.num_computed_tokens == 8
    assert sched_b.block_ids[:2] == [0, 1] and 2 not in sched_b.block_ids


def test_prefix_hits_produce_the_same_tokens_as_a_cold_run(runner_factory, alone):
    runner = runner_factory(num_blocks=40, block_size=4, max_num_batched_tokens=24)
    system = prompt(9, 17)
    wanted = {}
    for i in range(8):
        p = system + prompt(i, 1 + i)
        runner.add(f"r{i}", p, 6)
        wanted[f"r{i}"] = alone(p, 6)
    assert runner.run() == wanted
    # r1 is admitted in r0's step, before r0's KV exists; r2..r7 each reuse the 4 full system blocks.
    assert runner.scheduler.prefix_cache_hits == 6 * 16


def _put_victim_in(runner, state: str) -> Request:
    """Bring request "victim" into `state` on a 4-block pool shared with request "a"."""
    if state == "waiting":
        return runner.add("victim", prompt(2, 3), 5)
    if state == "prefilling":
        victim = runner.add("victim", prompt(2, 14), 1)
        runner.step()
        return victim
    runner.add("a", prompt(1, 7), 8)
    victim = runner.add("victim", prompt(2, 7), 1 if state == "finished" else 8)
    steps = {"running": 1, "finished": 1, "preempted": 3}[state]
    for _ in range(steps):
        runner.step()
    return victim


@pytest.mark.parametrize("state", ["waiting", "prefilling", "running", "preempted", "finished"])
def test_abort_in_any_state_frees_everything(runner_factory, state):
    budget = 8 if state == "prefilling" else 16
    runner = runner_factory(num_blocks=4, block_size=4, max_num_batched_tokens=budget, max_model_len=16)
    sched = runner.scheduler
    victim = _put_victim_in(runner, state)
    expected = {
        "waiting": RequestStatus.WAITING,
        "prefilling": RequestStatus.RUNNING,
        "running": RequestStatus.RUNNING,
        "preempted": RequestStatus.PREEMPTED,
        "finished": RequestStatus.FINISHED_LENGTH,
    }[state]
    assert victim.status == expected
    if state == "prefilling":
        assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    sched.abort("victim")
    assert sched.block_manager.get_block_table("victim") == []
    assert sched.get_request("victim") is None
    if state != "finished":
        assert victim.status == RequestStatus.FINISHED_ABORTED
        assert "victim" in sched.schedule().finished_ids
        assert "victim" not in sched.schedule().finished_ids
    held = {b for t in sched.block_manager.block_tables.values() for b in t}
    assert sched.block_manager.num_free_blocks == 4 - len(held)
    assert sched.num_running + sched.num_waiting == len(sched.requests)
    runner.run()
    assert sched.kv_cache_usage() == 0.0


def test_finished_ids_are_reported_once_at_the_next_schedule(runner_factory):
    runner = runner_factory()
    runner.add("a", prompt(1, 3), 1)
    runner.step()
    assert runner.scheduler.schedule().finished_ids == ["a"]
    assert runner.scheduler.schedule().finished_ids == []


def test_forked_children_share_blocks_and_generate_independently(runner_factory, alone):
    runner = runner_factory(num_blocks=24, block_size=4)
    sched = runner.scheduler
    p = prompt(3, 6)
    runner.add("g0", p, 8)
    runner.step()
    parent = sched.get_request("g0")
    first = parent.output_token_ids[0]
    runner.fork("g0", "g1", next_tok=(first + 1) % 50)
    runner.fork("g0", "g2", next_tok=(first + 2) % 50)
    assert sched.block_manager.get_block_table("g1") == [0, 1]
    assert sched.block_manager.blocks[1].ref_cnt == 3
    out = runner.step()
    assert sorted(out.block_copies) == [(1, 2), (1, 3)]
    outputs = runner.run()
    assert outputs["g0"] == alone(p, 8)
    assert outputs["g1"] == alone(p, 8, forced=[(first + 1) % 50])
    assert outputs["g2"] == alone(p, 8, forced=[(first + 2) % 50])
    assert sched.kv_cache_usage() == 0.0


def test_fork_of_a_request_that_is_not_running_is_refused(runner_factory):
    runner = runner_factory()
    runner.add("a", prompt(1, 4), 4)
    with pytest.raises(ValueError, match="running"):
        runner.scheduler.fork_request("a", Request("b", prompt(1, 4)))


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "field", "match"),
    [
        (40, 30, "max_tokens", "max_model_len"),
        (64, None, "prompt_token_ids", "shorter than max_model_len"),
        (20, 30, "max_tokens", "more than the whole cache"),
    ],
)
def test_request_that_can_never_fit_is_refused_at_add(runner_factory, prompt_len, max_tokens, field, match):
    runner = runner_factory(num_blocks=11, block_size=4, max_model_len=64)
    request = Request("big", prompt(1, prompt_len), SamplingParams(max_tokens=max_tokens))
    with pytest.raises(InvalidRequestError, match=match) as info:
        runner.scheduler.add_request(request)
    assert info.value.field == field
    assert not runner.scheduler.has_unfinished_requests()


def test_largest_request_that_fits_the_pool_completes_alone(runner_factory, alone):
    runner = runner_factory(num_blocks=11, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    p = [1] * 30
    runner.add("big", p, 14)
    runner.add("small", prompt(2, 5), 14)
    outputs = runner.run()
    assert outputs["big"] == alone(p, 14)


def test_max_tokens_none_is_resolved_to_the_room_left(runner_factory):
    runner = runner_factory(num_blocks=64, max_model_len=40)
    request = Request("a", prompt(1, 10), SamplingParams(max_tokens=None))
    runner.scheduler.add_request(request)
    assert request.max_tokens == 30


def test_duplicate_id_and_full_queue_are_refused(runner_factory):
    # One running slot, two waiting places: the first arrival takes the slot at the next step, so it
    # does not count against the queue; the fourth is refused.
    runner = runner_factory(max_num_waiting=2, max_num_seqs=1)
    runner.add("a", prompt(1, 4), 4)
    with pytest.raises(InvalidRequestError) as info:
        runner.add("a", prompt(1, 4), 4)
    assert info.value.field == "request_id"
    runner.add("b", prompt(1, 4), 4)
    runner.add("c", prompt(1, 4), 4)
    with pytest.raises(ServerBusyError):
        runner.add("d", prompt(1, 4), 4)
    runner.scheduler.abort("a")
    runner.add("d", prompt(1, 4), 4)


def test_queue_limit_counts_the_same_whether_a_burst_arrives_before_or_after_a_step(runner_factory):
    def admitted(step_after_first: bool) -> int:
        runner = runner_factory(max_num_waiting=4, max_num_seqs=2, num_blocks=64)
        accepted = 0
        for i in range(12):
            try:
                runner.add(f"r{i}", prompt(i + 1, 4), 20)
                accepted += 1
            except ServerBusyError:
                pass
            if step_after_first and i == 0:
                runner.step()
        return accepted

    assert admitted(step_after_first=False) == admitted(step_after_first=True) == 6


def test_kv_cache_usage_tracks_held_blocks(runner_factory):
    runner = runner_factory(num_blocks=10, block_size=4)
    assert runner.scheduler.kv_cache_usage() == 0.0
    runner.add("a", prompt(1, 8), 5)
    runner.step()
    assert runner.scheduler.kv_cache_usage() == pytest.approx(0.2)


def test_requests_aborted_while_queued_do_not_pile_up_behind_a_blocked_head(runner_factory):
    runner = runner_factory(num_blocks=4, block_size=4, max_model_len=16)
    runner.add("big", prompt(1, 12), 4)
    runner.step()
    runner.add("head", prompt(2, 12), 4)  # cannot be admitted while "big" runs
    for i in range(1000):
        runner.add(f"gone{i}", prompt(3, 4), 2)
        runner.scheduler.abort(f"gone{i}")
    assert runner.scheduler.num_waiting == 1
    assert len(runner.scheduler.waiting) < 100
    assert set(runner.run()) == {"big", "head"}
