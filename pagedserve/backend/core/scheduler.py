"""Iteration-level scheduler: one token budget per step, running requests first, then waiting ones in the
order of the scheduling policy (arrival, or priority then arrival)."""

from __future__ import annotations

import bisect
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from pagedserve.backend.core.block_manager import BlockManager
from pagedserve.backend.core.config import CacheConfig, SchedulerConfig
from pagedserve.backend.core.errors import InvalidRequestError, ServerBusyError
from pagedserve.backend.core.multimodal import ImageInput, StepEncoderCache
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.request_queue import FCFSQueue, PriorityQueue, priority_key

_RUNNING = RequestStatus.RUNNING
# Steps a request may wait for a LoRA slot while others take the running adapters' slots; past it, requests of
# running adapters stop being admitted until the slots turn over, so no adapter starves.
LORA_MAX_WAIT_STEPS = 32


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens all_token_ids[c : c+k] at positions c .. c+k-1, where the last
    len(spec_token_ids) of the k are those draft tokens (speculative decoding), not yet in all_token_ids."""

    request: Request
    num_scheduled_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    new_block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one forward, as plain data.

    `block_ids` lists are the live block tables: read them before the next schedule(), never mutate.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Images the runner encodes before this step's forward; encoder-cache entries it drops (core/multimodal.py).
    encoder_inputs: list[ImageInput] = field(default_factory=list)
    evicted_images: list[str] = field(default_factory=list)


class Scheduler:
    """Decides which requests run each step and owns their KV blocks through the BlockManager.

    Under the priority policy `running` is kept in priority order, so its last request is always the one
    to preempt (the lowest priority, the latest arrival), as under FCFS it is the newest.
    Not thread-safe; call schedule() and update_from_output() alternately from one thread.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_loras: int = 0, resident_loras: Container[int] = ()) -> None:
        self.config = scheduler_config
        # LoRA adapters running requests may use at once (the runner's slots; 0: LoRA is off), and the load
        # ids of those resident in a slot now (the runner updates it in place).
        self.max_loras = max_loras
        self.resident_loras = resident_loras
        self._lora_waits: dict[str, int] = {}  # request id -> steps it waited for a LoRA slot
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self._by_priority = scheduler_config.scheduling_policy == "priority"
        # Finished (aborted) requests are swept lazily from both queues, so removal is O(1).
        self.waiting: FCFSQueue | PriorityQueue = PriorityQueue() if self._by_priority else FCFSQueue()
        self.running: list[Request] = []
        # Running requests of n > 1 (or beam search) that have not sampled yet: each forks into all its
        # sequences at its first token, so their max_num_seqs slots are taken from admission on.
        self._unforked: list[Request] = []
        self._num_waiting = 0
        self._finished_ids: list[str] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.encoder_cache = StepEncoderCache(scheduler_config.encoder_cache_rows, scheduler_config.encoder_budget)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self.requests) - self._num_waiting

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission, preempted ones included."""
        return self._num_waiting

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests; 0.0 when idle."""
        return self.block_manager.usage()

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse one that can never fit or arrives when the queue is full."""
        cfg = self.config
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use", "request_id")
        pooled = request.pooling_params is not None  # prefill only: its prompt may fill max_model_len
        if request.num_prompt_tokens >= cfg.max_model_len + pooled:
            raise InvalidRequestError(
                f"prompt must be {'at most' if pooled else 'shorter than'} max_model_len ({cfg.max_model_len}) tokens, got "
                f"{request.num_prompt_tokens}",
                "prompt_token_ids",
            )
        if request.max_tokens is None:
            request.max_tokens = cfg.max_model_len - request.num_prompt_tokens
        total = request.num_prompt_tokens + request.max_tokens
        if total > cfg.max_model_len:
            raise InvalidRequestError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) must be "
                f"<= max_model_len ({cfg.max_model_len}), got {total}",
                "max_tokens",
            )
        num_blocks_needed = -(-total // self.block_size)
        if num_blocks_needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens ({total} tokens) needs {num_blocks_needed} KV blocks, more than the "
                f"whole cache ({self.block_manager.num_blocks} blocks of {self.block_size} tokens)",
                "max_tokens",
            )
        # Requests that free running slots will take at the next step are not queued behind anyone: only
        # the ones beyond them count against max_num_waiting, so a burst onto an idle server is refused
        # the same way however its arrivals interleave with steps.
        free_slots = max(cfg.max_num_seqs - len(self.running), 0)
        if self._num_waiting - free_slots >= cfg.max_num_waiting:
            raise ServerBusyError(f"server busy: {self._num_waiting} requests already waiting")
        self._enqueue(request)

    def requeue(self, request: Request) -> None:
        """Queue again a sequence of an admitted request (a beam that gave its blocks back, a beam forked
        from a preempted one): no admission check, so it cannot be refused halfway through its request."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use", "request_id")
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.requests[request.request_id] = request
        if len(self.waiting) > 2 * self._num_waiting + 64:
            # Aborted requests stay queued until they reach the head; drop them in one amortised pass.
            self.waiting.compact()
        self.waiting.add(request)
        self._num_waiting += 1

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests (decode or next prefill chunk), then admit waiting ones."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self.running = [r for r in self.running if r.status == _RUNNING]
        self.encoder_cache.start_step()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_ids:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        out.block_copies = self.block_manager.take_block_copies()
        out.encoder_inputs, out.evicted_images = self.encoder_cache.take_step()
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int], num_accepted: dict[str, int] | None = None
    ) -> None:
        """Record the step's results: computed tokens advance, sampled tokens append, full blocks cache.

        `num_accepted[request_id]`: how many of its draft tokens were accepted (appended before its sampled
        token); the rejected ones' computed tokens and blocks roll back. No entry: all rejected."""
        cache_full_blocks = self.block_manager.cache_full_blocks
        bs = self.block_size
        for sched in out.scheduled:
            request = sched.request
            if request.status != _RUNNING:
                continue
            before = request.num_computed_tokens
            num_rejected = 0
            if sched.spec_token_ids:
                num_rejected = self._accept_drafts(sched, (num_accepted or {}).get(request.request_id, 0))
            after = request.num_computed_tokens = before + sched.num_scheduled_tokens - num_rejected
            if request.mm_inputs:
                self.encoder_cache.release_computed(request.request_id, request.mm_inputs, after)
            if sched.sample:
                token = sampled.get(request.request_id)
                if token is not None:
                    request.output_token_ids.append(token)
                    request.all_token_ids.append(token)
            if num_rejected:
                self.block_manager.trim(request, request.num_tokens)
            if after // bs != before // bs:
                cache_full_blocks(request)

    def _accept_drafts(self, sched: ScheduledRequest, num_accepted: int) -> int:
        """Append the accepted draft tokens; returns how many were rejected."""
        accepted = sched.spec_token_ids[:num_accepted]
        sched.request.output_token_ids.extend(accepted)
        sched.request.all_token_ids.extend(accepted)
        return len(sched.spec_token_ids) - len(accepted)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Start `child` as a running copy of the parent that shares all its KV blocks.

        The child takes the parent's tokens whose KV is computed; the caller appends its next token.
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"fork parent {parent_id!r} must be a running request")
        if child.request_id in self.requests:
            raise InvalidRequestError(f"request_id {child.request_id!r} is already in use", "request_id")
        computed = parent.num_computed_tokens
        child.prompt_token_ids = list(parent.prompt_token_ids)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.mm_inputs = parent.mm_inputs  # a preempted child recomputes the prompt, images included
        child.all_token_ids = parent.all_token_ids[: max(computed, parent.num_prompt_tokens)]
        child.output_token_ids = child.all_token_ids[parent.num_prompt_tokens :]
        child.num_computed_tokens = computed
        child.num_cached_tokens = parent.num_cached_tokens
        if child.max_tokens is None:
            child.max_tokens = parent.max_tokens
        # A sequence of the parent's request keeps that request's place in line.
        child.priority, child.arrival_time = parent.priority, parent.arrival_time
        child.status = RequestStatus.RUNNING
        self.block_manager.fork(parent, child)
        self.requests[child.request_id] = child
        self._add_running(child)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests in any state with a finished status and free their blocks."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished state, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self._num_waiting -= 1
            request.status = status
            self.block_manager.free(request)
            self.encoder_cache.release(request_id)
            self._finished_ids.append(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request in any state; unknown or finished ids are ignored."""
        self.finish_requests((request_id,), RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block hash (e.g. after weights change)."""
        self.block_manager.reset_prefix_cache()

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        allocate_slots = self.block_manager.allocate_slots
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if request.mm_inputs:
                num_new = self.encoder_cache.plan(request.mm_inputs, request.num_computed_tokens, num_new)
            if num_new <= 0:
                index += 1
                continue
            spec = _take_drafts(request, num_new, budget)
            # Drafts only take free blocks: short of them, the request decodes one token and nobody is preempted.
            new_block_ids = allocate_slots(request, num_new + len(spec)) if spec else None
            if new_block_ids is None:
                spec = []
                new_block_ids = allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
                new_block_ids = allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            if request.mm_inputs:
                self.encoder_cache.commit(request.request_id, request.mm_inputs, request.num_computed_tokens)
            self._add_scheduled(out, request, num_new, new_block_ids, spec)
            budget -= num_new + len(spec)
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        waiting = self.waiting
        if self._unforked:
            self._unforked = [r for r in self._unforked if r.status == _RUNNING and not r.num_output_tokens]
        occupied = self._occupied_slots()
        adapters = self._lora_admission() if self.max_loras else None
        skipped: list[Request] = []
        while waiting and budget > 0:
            request = waiting.peek()
            if request.is_finished:
                waiting.pop()
                continue
            if adapters is not None and not adapters.admits(request):
                if len(skipped) >= self.config.max_num_seqs:
                    break
                skipped.append(waiting.pop())
                self._lora_waits[request.request_id] = self._lora_waits.get(request.request_id, 0) + 1
                continue
            seqs = _sequences_once_running(request)
            admitted = self._allocate_waiting(request, seqs, occupied, budget)
            if admitted is None:
                refund = self._preempt_for(request, out)
                if refund is None:
                    break
                budget += refund
                occupied = self._occupied_slots()
                continue
            num_hit_tokens, num_new, new_block_ids = admitted
            waiting.pop()
            self._num_waiting -= 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            self._add_running(request)
            if adapters is not None:
                adapters.add(request)
            occupied += seqs
            if seqs > 1:
                self._unforked.append(request)
            if num_new > 0:
                self._add_scheduled(out, request, num_new, new_block_ids)
                budget -= num_new
        for request in reversed(skipped):  # back at the head, in their order
            waiting.add_preempted(request)
        return budget

    def _lora_admission(self) -> LoRAAdmission:
        """This step's LoRA admission; draining when a request waited LORA_MAX_WAIT_STEPS for a slot."""
        waits = self._lora_waits
        if waits:
            requests = self.requests
            for request_id in [rid for rid in waits if rid not in requests or requests[rid].status == _RUNNING]:
                del waits[request_id]
        draining = any(n >= LORA_MAX_WAIT_STEPS for n in waits.values())
        return LoRAAdmission(self.running, self.max_loras, self.resident_loras, draining)

    def _occupied_slots(self) -> int:
        """max_num_seqs slots taken: running sequences, plus those unforked requests will fork into."""
        extra = sum(_sequences_once_running(r) - 1 for r in self._unforked if r.status == _RUNNING)
        return len(self.running) + extra

    def _allocate_waiting(
        self, request: Request, seqs: int, occupied: int, budget: int
    ) -> tuple[int, int, list[int]] | None:
        """Slots for admitting `request` now: (prefix-cached tokens, new tokens, new block ids), or None
        when its sequences or its blocks do not fit."""
        if self.running and occupied + seqs > self.config.max_num_seqs:
            return None
        bm = self.block_manager
        hits, num_hit_tokens = bm.get_computed_blocks(request)
        num_new = min(max(request.num_tokens - num_hit_tokens, 0), budget)
        if request.mm_inputs:
            num_new = self.encoder_cache.plan(request.mm_inputs, num_hit_tokens, num_new)
        if request.whole_prompt and num_new < request.num_tokens - num_hit_tokens:
            return None  # it waits for a step with room for all of it
        new_block_ids = bm.allocate_slots(request, num_new, hits, num_hit_tokens)
        if new_block_ids is None:
            return None
        if request.mm_inputs:
            self.encoder_cache.commit(request.request_id, request.mm_inputs, num_hit_tokens)
        return num_hit_tokens, num_new, new_block_ids

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> int | None:
        """Priority policy: the last running request gives way to a waiting one of a strictly higher
        priority, leaving this step if it was in it. Returns the tokens it gives back; None if none gives way."""
        running = self.running
        if not self._by_priority or not running or running[-1].priority <= request.priority:
            return None
        victim = running.pop()
        refund = 0
        for index in range(len(out.scheduled) - 1, -1, -1):
            if out.scheduled[index].request is victim:
                refund = out.scheduled.pop(index).num_scheduled_tokens
                break
        self._preempt(victim, out)
        return refund

    def _add_running(self, request: Request) -> None:
        if self._by_priority:
            bisect.insort_right(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def _add_scheduled(
        self, out: SchedulerOutput, request: Request, num_new: int, new_block_ids: list[int],
        spec: list[int] | None = None,
    ) -> None:
        computed = request.num_computed_tokens
        out.scheduled.append(
            ScheduledRequest(
                request,
                num_new + len(spec or ()),
                computed,
                self.block_manager.block_tables[request.request_id],
                new_block_ids,
                computed + num_new == len(request.all_token_ids),
                spec or [],
            )
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: free everything, keep the tokens, rejoin the queue (FCFS: its front)."""
        self.block_manager.free(request)
        self.encoder_cache.release(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.add_preempted(request)
        self._num_waiting += 1
        self.num_preemptions += 1
        out.preempted_ids.append(request.request_id)


class LoRAAdmission:
    """Which waiting requests' LoRA adapters fit this step: at most `max_loras` distinct adapters among running
    requests (the runner's slots), and at most one admitted per step whose adapter is not resident, so that no
    request's step waits on more than one adapter load. A request that does not fit waits; others go on, but
    while `draining` (one waited too long) requests of running adapters wait too, so that the slots turn over."""

    __slots__ = ("running", "max_loras", "resident", "loads", "draining")

    def __init__(self, running: Iterable[Request], max_loras: int, resident: Container[int],
                 draining: bool = False) -> None:
        self.running = {r.sampling_params.lora_int_id for r in running} - {0}
        self.max_loras = max_loras
        self.resident = resident
        self.loads = 0
        self.draining = draining

    def admits(self, request: Request) -> bool:
        """Whether `request` may be admitted now."""
        lora_id = request.sampling_params.lora_int_id
        if not lora_id:
            return True
        if lora_id in self.running:
            return not self.draining
        return len(self.running) < self.max_loras and (lora_id in self.resident or not self.loads)

    def add(self, request: Request) -> None:
        """Record an admitted request's adapter."""
        lora_id = request.sampling_params.lora_int_id
        if lora_id and lora_id not in self.running:
            self.running.add(lora_id)
            self.loads += lora_id not in self.resident


def _take_drafts(request: Request, num_new: int, budget: int) -> list[int]:
    """The request's draft tokens that fit this step (taken off it): only a decode (one new token) has any."""
    spec = request.spec_token_ids
    if not spec:
        return spec
    request.spec_token_ids = []
    return spec[: budget - 1] if num_new == 1 else []


def _sequences_once_running(request: Request) -> int:
    """How many running sequences admitting `request` makes: a request of n > 1 (or beam search) that has
    not sampled yet forks into all of them at its first token, so it takes their max_num_seqs slots now."""
    if request.num_output_tokens:
        return 1
    params = request.sampling_params
    return max(params.n, params.beam_width)
