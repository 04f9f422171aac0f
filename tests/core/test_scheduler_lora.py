"""The scheduler's LoRA constraint: no step runs more distinct adapters than max_loras, at most one adapter that is
not resident is admitted per step, and a request whose adapter cannot get a slot waits while others go on."""

from __future__ import annotations

import random

from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams


def _request(request_id: str, lora_id: int, length: int = 5, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, lora_name=f"a{lora_id}" if lora_id else None)
    params.lora_int_id = lora_id
    return Request(request_id, [(7 * i + len(request_id)) % 40 + 1 for i in range(length)], params)


def _lora_runner(runner_factory, max_loras: int, resident: list[int] | None = None, **kwargs):
    runner = runner_factory(num_blocks=64, block_size=4, max_num_batched_tokens=64, **kwargs)
    runner.scheduler.max_loras = max_loras
    runner.scheduler.resident_loras = resident if resident is not None else [0] * max_loras
    return runner


def _step_ids(runner) -> list[str]:
    return [s.request.request_id for s in runner.step().scheduled]


def test_a_request_whose_adapter_has_no_slot_waits_and_those_behind_it_go_on(runner_factory):
    runner = _lora_runner(runner_factory, max_loras=1, resident=[1])
    for request in [_request("a1", 1), _request("b", 2), _request("a2", 1), _request("base", 0)]:
        runner.scheduler.add_request(request)
    assert _step_ids(runner) == ["a1", "a2", "base"]
    assert [r.request_id for r in runner.scheduler.waiting] == ["b"]
    runner.run()
    assert set(runner.outputs) == {"a1", "b", "a2", "base"}


def test_one_adapter_load_per_step_resident_ones_need_none(runner_factory):
    runner = _lora_runner(runner_factory, max_loras=3, resident=[0, 0, 0])
    for request in [_request("a", 1), _request("b", 2), _request("base", 0), _request("c", 3)]:
        runner.scheduler.add_request(request)
    assert _step_ids(runner) == ["a", "base"]
    assert _step_ids(runner)[-1:] == ["b"]
    assert _step_ids(runner)[-1:] == ["c"]

    resident = _lora_runner(runner_factory, max_loras=3, resident=[2, 0, 3])
    for request in [_request("a", 1), _request("b", 2), _request("c", 3)]:
        resident.scheduler.add_request(request)
    assert _step_ids(resident) == ["a", "b", "c"]


def test_no_step_runs_more_adapters_than_slots_and_nothing_is_lost(runner_factory, alone):
    runner = _lora_runner(runner_factory, max_loras=2, max_num_seqs=8)
    rng = random.Random(0)
    wanted = {}
    for i in range(24):
        request = _request(f"r{i}", rng.choice([0, 1, 2, 3, 4]), length=3 + i % 7, max_tokens=2 + i % 5)
        runner.scheduler.add_request(request)
        wanted[request.request_id] = alone(request.prompt_token_ids, request.max_tokens)
    while runner.scheduler.has_unfinished_requests():
        out = runner.step()
        running = {r.sampling_params.lora_int_id for r in runner.scheduler.running} - {0}
        assert len(running) <= 2
        resident = runner.scheduler.resident_loras  # play the runner: the step's adapters take the slots
        step = sorted({s.request.sampling_params.lora_int_id for s in out.scheduled} - {0})
        resident[:] = (step + [i for i in resident if i not in step])[:2]
    assert runner.outputs == wanted


def test_an_adapter_kept_out_by_a_stream_of_another_gets_its_slot(runner_factory):
    from pagedserve.backend.core.scheduler import LORA_MAX_WAIT_STEPS

    runner = _lora_runner(runner_factory, max_loras=1, resident=[1], max_num_seqs=64)
    runner.scheduler.add_request(_request("a0", 1, max_tokens=8))
    runner.scheduler.add_request(_request("b", 2, max_tokens=2))
    for step in range(1, 200):  # a new request of adapter 1 arrives every step
        runner.scheduler.add_request(_request(f"a{step}", 1, max_tokens=8))
        if "b" in _step_ids(runner):
            break
    assert LORA_MAX_WAIT_STEPS <= step <= LORA_MAX_WAIT_STEPS + 8 + 1
