"""The offline LLMEngine: validate and queue requests, run scheduled steps, apply stop conditions.

Not thread-safe: one thread drives add_request / abort_request / step.
"""

from __future__ import annotations

import atexit
import functools
import gc
import heapq
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pagedserve.backend.core.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedserve.backend.core.errors import ErrorKind, InvalidRequestError, RequestTimeoutError
from pagedserve.backend.core.outputs import EngineStats, RequestOutput
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.backend.engine.beam_search import BeamGroup
from pagedserve.backend.engine.engine_args import engine_args
from pagedserve.backend.engine.input_processing import (
    check_beams_fit,
    check_params,
    check_priority_policy,
    resolve_logits_params,
    resolve_prompt,
    truncate_prompt,
)
from pagedserve.backend.engine.lora import LoRAEngineMixin, LoRARegistry
from pagedserve.backend.engine.request_group import RequestGroup, SamplingGroup, SequenceState, StepBatch
from pagedserve.backend.engine.spec_draft import make_speculator
from pagedserve.backend.engine.spec_verify import Run, sample_step
from pagedserve.backend.engine.speculative import record_run
from pagedserve.backend.engine.structured import StructuredOutputs
from pagedserve.backend.model import ModelArchConfig, load_eos_token_ids, load_tokenizer
from pagedserve.backend.worker.model_runner import ModelRunnerOutput
from pagedserve.backend.worker.sampler import Sampler, SamplerOutput
from pagedserve.backend.worker.tp_workers import start_runner

logger = logging.getLogger(__name__)

FaultInjector = Callable[[SchedulerOutput], None]


@functools.cache
def _unfreeze_at_exit() -> None:
    """Hand frozen objects back to the collector at exit, so interpreter shutdown frees them as usual."""
    atexit.register(gc.unfreeze)


class LLMEngine(LoRAEngineMixin):
    """Paged-KV-cache generation over a Llama-family model; `step()` runs one scheduled forward."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
        speculative_config: SpeculativeConfig | None = None, lora_config: LoRAConfig | None = None,
        lora_modules: dict[str, str] | None = None,
    ):
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        ModelArchConfig.from_pretrained(model_config.model)  # a missing or unsupported model fails first
        self.tokenizer = load_tokenizer(model_config.model)
        # With tensor_parallel_size > 1 this is rank 0's runner and `workers` the other ranks' processes.
        self.runner, self.workers = start_runner(model_config, cache_config, scheduler_config, lora_config)
        self.lora = LoRARegistry(lora_config, self.runner.lora)
        arch: ModelArchConfig = self.runner.arch
        self.vocab_size = arch.vocab_size
        self.eos_token_ids: set[int] = load_eos_token_ids(model_config.model, arch, self.tokenizer)
        self.scheduler = Scheduler(scheduler_config, cache_config, self.runner.num_blocks, **self.lora.scheduler_args())
        self.sampler = Sampler(self.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.speculator = make_speculator(speculative_config, self)
        # Test hook: called with the SchedulerOutput before each forward; raising fails that step's requests.
        self.fault_injector: FaultInjector | None = None
        self._groups: dict[str, RequestGroup] = {}  # by user request id
        self._owner: dict[str, RequestGroup] = {}  # by scheduler request id: the group it belongs to
        self._to_report: dict[str, RequestGroup] = {}  # touched since the last step's outputs
        self._error_kinds: dict[str, ErrorKind] = {}  # by user request id, for an error that is not INTERNAL
        # A heap of (deadline, token, request id) and, by request id, (token, timeout in seconds) while the
        # request lives: a heap entry whose token is not its request's any more (it ended) is skipped.
        self._deadlines: list[tuple[float, int, str]] = []
        self._timeouts: dict[str, tuple[int, float]] = {}
        self._deadline_tokens = itertools.count()
        self._id_counter = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._load_lora_modules(lora_modules)

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> LLMEngine:
        """Load a Hugging Face model folder; kwargs: the configs' fields, `speculative_config` (dict or JSON),
        `lora_modules` (adapter name -> PEFT folder, loaded at start)."""
        args = engine_args(model, kwargs)
        engine = cls(args.model_config, args.cache_config, args.scheduler_config, args.speculative_config,
                     args.lora_config, args.lora_modules)
        # What start-up made (weights' modules, tokenizer, block pool) lives as long as the engine: out of
        # the garbage collector's full passes, which otherwise rescan it every few hundred steps.
        gc.collect()
        gc.freeze()
        _unfreeze_at_exit()
        return engine

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
        timeout: float | None = None,
    ) -> None:
        """Validate and queue a request; bad input raises InvalidRequestError naming the field.

        `add_special_tokens=False` tokenizes a text prompt without the tokenizer's own special tokens (a BOS):
        for a prompt rendered from a chat template, which has them already (as vLLM's chat API does).
        `priority` orders it under the "priority" scheduling policy (lower first); a `timeout` in seconds
        from `arrival_time` (time.monotonic(), default now) ends it with a TIMEOUT error once it passes."""
        self._check_request_id(request_id)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}", "sampling_parameters"
            )
        token_ids = resolve_prompt(self.tokenizer, self.vocab_size, prompt, prompt_token_ids,
                                     add_special_tokens)
        check_params(params, self.scheduler_config.max_num_seqs)
        self.lora.resolve(params)
        _check_timeout(timeout)
        check_priority_policy(priority, self.scheduler_config.scheduling_policy)
        token_ids = truncate_prompt(token_ids, params, self.scheduler_config.max_model_len)
        resolve_logits_params(self.tokenizer, self.vocab_size, params)
        # Compiled before the request takes any KV: a spec that does not compile is refused here.
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        salt = None
        if params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position, so such a request never hits the cache.
            salt = f"prompt-logprobs-{uuid.uuid4().hex}"
        request = Request(
            request_id, token_ids, params, arrival_time=arrival_time, cache_salt=salt, group_id=request_id,
            priority=priority,
        )
        self.scheduler.add_request(request)
        group: RequestGroup
        if params.beam_width > 1:
            try:
                check_beams_fit(request, self.cache_config, self.runner.num_blocks)
            except InvalidRequestError:
                self.scheduler.abort(request_id)
                raise
            group = BeamGroup(request_id, prompt, request, params, self.eos_token_ids, self._decode)
        else:
            new_matcher = (lambda: self.structured.matcher(grammar)) if grammar is not None else None
            group = SamplingGroup(request_id, prompt, request, self.tokenizer, self._unused_id, new_matcher)
        self._groups[request_id] = self._owner[request_id] = group
        if timeout is not None:
            self._watch_deadline(request_id, request.arrival_time + timeout, timeout)

    def _check_request_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self._groups or request_id in self._owner:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")

    def _watch_deadline(self, request_id: str, deadline: float, timeout: float) -> None:
        token = next(self._deadline_tokens)
        self._timeouts[request_id] = (token, timeout)
        heapq.heappush(self._deadlines, (deadline, token, request_id))

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def abort_request(self, request_id: str) -> None:
        """Abort a user request (all its sequences); its final output comes from the next step()."""
        group = self._groups.get(request_id)
        if group is not None and not group.finished:
            self._end_group(group, RequestStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device); the engine runs no step after this."""
        if self.workers is not None:
            self.workers.stop()

    def failure(self) -> str | None:
        """Why this engine can run no further step (a tensor-parallel rank is gone); None while it can."""
        return None if self.workers is None else self.workers.group.failure

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running, or has a final output not yet returned."""
        return bool(self._groups)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward; one output per user request that got tokens or finished."""
        if self._deadlines:
            self._end_timed_out()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.scheduled:
            try:
                if self.fault_injector is not None:
                    self.fault_injector(sched)
                runner_out = self.runner.execute(sched)
                if self.speculator is not None:
                    self.speculator.observe(sched)  # a draft model runs the same step
                self._process(sched, runner_out)
            except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
                logger.exception("step failed; ending its %d requests with an error", len(sched.scheduled))
                self._fail_step(sched, f"{type(exc).__name__}: {exc}")
        else:
            self.scheduler.update_from_output(sched, {})
            if self.scheduler.num_waiting:
                self._release_stalled_beams()
        return self._collect_outputs()

    def _end_timed_out(self) -> None:
        """End every request whose timeout passed, waiting or running, with a TIMEOUT error; its blocks
        are freed before this step is scheduled."""
        now = time.monotonic()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, token, request_id = heapq.heappop(deadlines)
            entry = self._timeouts.get(request_id)
            group = self._groups.get(request_id)
            if entry is None or entry[0] != token or group is None or group.finished:
                continue
            error = RequestTimeoutError(
                f"request timeout expired: the request did not finish within its timeout of {entry[1]:g} s"
            )
            self._end_group(group, RequestStatus.FINISHED_ERROR, str(error), ErrorKind.TIMEOUT)

    def _release_stalled_beams(self) -> None:
        """Nothing could run: beams that wait for preempted siblings hold the blocks those siblings need.

        The newest such beam group gives its blocks back; its beams recompute once readmitted.
        """
        holding = [g for g in self._groups.values() if g.stalled_running()]
        if not holding:
            return
        group = max(holding, key=lambda g: g.arrival_time)
        running = group.stalled_running()
        logger.info(
            "beam group %s releases %d beams' blocks to break a stall", group.request_id, len(running)
        )
        self.scheduler.finish_requests([r.request_id for r in running], RequestStatus.FINISHED_STOPPED)
        for request in running:
            self.scheduler.requeue(request)

    def _process(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Sample, advance the scheduler, fork n>1 children, step beam searches, apply stop conditions."""
        for rid, (start, logits) in runner_out.prompt_logits.items():
            self._owner[rid].record_prompt_logits(rid, start, logits)
        batch = StepBatch()
        for row, rid in enumerate(runner_out.sample_request_ids):
            self._owner[rid].take_logits(rid, row, runner_out.sample_logits[row], batch)
        logits = runner_out.sample_logits
        if batch.rows != list(range(logits.shape[0])):  # the usual case needs no copy of the [R, V] logits
            logits = logits[batch.rows]
        step = sample_step(self.sampler, self.structured, logits, batch, sched, runner_out.spec_logits)
        sampled = None if step is None else step.sampled
        tokens = {} if sampled is None else dict(zip((r.request_id for r in batch.requests), sampled.token_ids,
                                                     strict=True))
        if step is not None and step.num_drafts:
            self.speculator.count(step.num_drafts, step.num_accepted)
        self.scheduler.update_from_output(sched, tokens, None if step is None else step.num_accepted)
        for group, child in batch.forks:
            self.scheduler.fork_request(group.seqs[0].request.request_id, child)
            child.append_output_token_id(tokens[child.request_id])
            group.adopt(child)
            self._owner[child.request_id] = group
        if step is not None:
            self._apply_tokens(batch, sampled, step.runs)
        for beam in batch.ready_beams.values():
            self._advance_beam(beam)

    def _unused_id(self, request_id: str) -> str:
        """`request_id`, suffixed until no user request or sequence holds it."""
        while request_id in self._groups or request_id in self._owner or self.scheduler.get_request(request_id):
            request_id += "'"
        return request_id

    def _apply_tokens(self, batch: StepBatch, sampled: SamplerOutput, runs: dict[str, Run]) -> None:
        """Record each sampled token (a speculating sequence's verified run, one by one) and finish the
        sequences they stop; a run's tokens after the one that stops it are dropped."""
        finished: dict[RequestStatus, list[str]] = {}
        for i, (group, request) in enumerate(zip(batch.groups, batch.requests, strict=True)):
            seq = group.sequence(request.request_id)
            run = runs.get(request.request_id)
            if run is None:
                status = self._record_token(seq, sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
            else:
                status = record_run(seq, run, self._record_token)
            if status is not None:
                seq.finish(status)
                finished.setdefault(status, []).append(request.request_id)
            self._to_report[group.request_id] = group
        for status, ids in finished.items():
            self.scheduler.finish_requests(ids, status)

    def _record_token(
        self, seq: SequenceState, token: int, logprob: float, top: dict[int, float] | None
    ) -> RequestStatus | None:
        """Record a token already appended to the sequence's Request; why it stops there, if it does."""
        request = seq.request
        if seq.index == 0 and request.num_output_tokens == 1:
            self._prompt_tokens += request.num_prompt_tokens
        self._generation_tokens += 1
        stop_token = self._is_stop_token(request, token)
        # As in vLLM, the text of an eos or stop token is not output unless include_stop_str_in_output.
        text = request.sampling_params.include_stop_str_in_output or not stop_token
        seq.add_token(token, logprob, top, text=text)
        return self._check_stop(seq, stop_token)

    def _advance_beam(self, beam: BeamGroup) -> None:
        """One beam-search step for a group whose live beams all have their logits."""
        if beam.live[0].num_output_tokens == 0:
            self._prompt_tokens += beam.live[0].num_prompt_tokens
        dropped = beam.advance(self.scheduler)
        self.scheduler.finish_requests(dropped, RequestStatus.FINISHED_STOPPED)
        for rid in dropped:
            self._owner.pop(rid, None)
        for request in beam.live:
            self._owner[request.request_id] = beam
        if beam.finished:
            self._to_report[beam.request_id] = beam
        else:
            self._generation_tokens += len(beam.live)

    def _check_stop(self, seq: SequenceState, stop_token: bool) -> RequestStatus | None:
        """Why this sequence stops after its newest token, if it does: stop string, eos, stop id
        (`stop_token`: `_is_stop_token` of that token), length."""
        request = seq.request
        if seq.stop_reason is not None:
            return RequestStatus.FINISHED_STOPPED
        if seq.matcher is not None and seq.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if stop_token:
            token = request.output_token_ids[-1]
            if token in request.sampling_params.stop_token_ids:
                seq.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.scheduler_config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _is_stop_token(self, request: Request, token: int) -> bool:
        """Whether `token`, the request's newest output token, ends it: eos (unless ignored) or a stop id,
        from min_tokens on."""
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return False
        return (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids

    def _fail_step(self, sched: SchedulerOutput, error: str) -> None:
        """End every user request with a sequence in this step with finish_reason "error"."""
        for item in sched.scheduled:
            group = self._groups.get(item.request.group_id or item.request.request_id)
            if group is not None and not group.finished:
                self._end_group(group, RequestStatus.FINISHED_ERROR, error)
        self.scheduler.update_from_output(sched, {})

    def _end_group(
        self, group: RequestGroup, status: RequestStatus, error: str | None = None,
        error_kind: ErrorKind = ErrorKind.INTERNAL,
    ) -> None:
        """Abort or fail every unfinished sequence of a user request; it reports on the next step."""
        self.scheduler.finish_requests(group.end(status, error), status)
        if error is not None and error_kind is not ErrorKind.INTERNAL:
            self._error_kinds[group.request_id] = error_kind
        self._to_report[group.request_id] = group

    def _collect_outputs(self) -> list[RequestOutput]:
        """Outputs of the groups touched since the last step; finished groups are forgotten."""
        outputs = []
        for group in self._to_report.values():
            out = group.output()
            if out.error is not None:
                out.error_kind = self._error_kinds.pop(group.request_id, ErrorKind.INTERNAL)
            outputs.append(out)
            if out.finished:
                self._forget(group)
        self._to_report.clear()
        return outputs

    def _forget(self, group: RequestGroup) -> None:
        del self._groups[group.request_id]
        self._error_kinds.pop(group.request_id, None)
        self._timeouts.pop(group.request_id, None)
        for request_id in group.sequence_ids():
            self._owner.pop(request_id, None)
            self.sampler.free(request_id)

    # ------------------------------------------------------------------ offline helpers

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (texts or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} params for {len(prompts)} prompts", "params")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = f"generate-{next(self._id_counter)}"
                if isinstance(prompt, str):
                    self.add_request(rid, prompt, p)
                else:
                    self.add_request(rid, None, p, prompt_token_ids=list(prompt))
                ids.append(rid)
        except Exception:
            # All or nothing: a refused prompt withdraws the ones queued before it.
            for rid in ids:
                self.abort_request(rid)
            self.step()
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def stream(
        self, prompt: str, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Add one request and yield its outputs step by step; closing the iterator aborts it."""
        rid = request_id or f"stream-{next(self._id_counter)}"
        self.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.abort_request(rid)

    def get_stats(self) -> EngineStats:
        """Current gauges and running totals for metrics."""
        sch = self.scheduler
        return EngineStats(
            num_running=sch.num_running,
            num_waiting=sch.num_waiting,
            kv_cache_usage=sch.kv_cache_usage(),
            prefix_cache_queries=sch.prefix_cache_queries,
            prefix_cache_hits=sch.prefix_cache_hits,
            num_preemptions=sch.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_blocks=self.runner.num_blocks,
            num_free_blocks=sch.block_manager.num_free_blocks,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **self.lora.stats(sch),
        )


def _check_timeout(timeout: object) -> None:
    """A request's timeout is None (none) or a finite number of seconds > 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidRequestError(f"timeout must be a number of seconds > 0, got {timeout!r}", "timeout")
