"""A deterministic fake model over a fake KV cache, to drive the scheduler exactly like an engine."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.config import CacheConfig, SchedulerConfig
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = 0


def compute_slot_mapping(block_ids, block_size: int, start: int, num_tokens: int) -> list[int]:
    """Cache slot of each token at positions start .. start+num_tokens-1 (the runner's rule, for the fake KV)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def next_token(context: list[int]) -> int:
    """The fake model: a fixed function of the whole token history."""
    h = 0
    for tok in context:
        h = (h * 31 + tok + 1) % 1_000_003
    return h % VOCAB


def generate_alone(prompt: list[int], max_tokens: int, forced: list[int] = ()) -> list[int]:
    """What a request produces with the machine to itself (forced tokens first, as a fork gets them)."""
    tokens = list(prompt)
    output: list[int] = []
    while len(output) < max_tokens:
        tok = forced[len(output)] if len(output) < len(forced) else next_token(tokens)
        tokens.append(tok)
        output.append(tok)
        if tok == EOS:
            break
    return output


class FakeRunner:
    """Plays the model runner: writes token ids into a fake KV cache through the slot mapping and
    samples from what it reads back, so a wrong block table or a missing copy changes the output."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        self.kv: list[int | None] = [None] * (scheduler.block_manager.num_blocks * self.block_size)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, RequestStatus] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int, **kwargs) -> Request:
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), **kwargs)
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        """One engine iteration: schedule, copy blocks, write KV, read it back to sample, update."""
        out = self.scheduler.schedule()
        bs = self.block_size
        for src, dst in out.block_copies:
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
        for sched in out.scheduled:
            c, k = sched.num_computed_tokens, sched.num_scheduled_tokens
            tokens = sched.request.all_token_ids[c : c + k]
            for slot, tok in zip(compute_slot_mapping(sched.block_ids, bs, c, k), tokens, strict=True):
                self.kv[slot] = tok
        sampled = {}
        for sched in out.scheduled:
            if sched.sample:
                end = sched.num_computed_tokens + sched.num_scheduled_tokens
                context = [self.kv[s] for s in compute_slot_mapping(sched.block_ids, bs, 0, end)]
                assert context == sched.request.all_token_ids[:end], f"KV of {sched.request} is corrupt"
                sampled[sched.request.request_id] = next_token(context)
        self.scheduler.update_from_output(out, sampled)
        self._finish_stopped(out)
        return out

    def _finish_stopped(self, out: SchedulerOutput) -> None:
        for sched in out.scheduled:
            request = sched.request
            if not sched.sample or request.is_finished:
                continue
            if request.output_token_ids[-1] == EOS or request.num_output_tokens >= request.max_tokens:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_LENGTH)
                self.outputs[request.request_id] = list(request.output_token_ids)

    def fork(self, parent_id: str, child_id: str, next_tok: int | None = None) -> Request:
        """Fork like the engine does for n>1: the child then takes its own next token."""
        parent = self.scheduler.get_request(parent_id)
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params)
        self.scheduler.fork_request(parent_id, child)
        if next_tok is not None and child.num_tokens == child.num_computed_tokens:
            child.append_output_token_id(next_tok)
        return child

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        """Step until every request finished; fail instead of looping forever."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.outputs
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def make_scheduler(
    num_blocks: int = 11,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    max_num_waiting: int = 4096,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    """A scheduler over a tiny pool."""
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            max_num_waiting=max_num_waiting,
            scheduling_policy=scheduling_policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


@pytest.fixture
def runner_factory():
    """Build a FakeRunner over a fresh tiny-pool scheduler: runner_factory(num_blocks=..., ...)."""
    return lambda **kwargs: FakeRunner(make_scheduler(**kwargs))


@pytest.fixture
def alone():
    """generate_alone(prompt, max_tokens, forced=()) -> the tokens a request makes on its own."""
    return generate_alone


@pytest.fixture
def fake_model():
    """next_token(context) -> the fake model's token for that history."""
    return next_token
