"""The offline LLMEngine: validate and queue requests, run scheduled steps, apply stop conditions.

Not thread-safe: one thread drives add_request / abort_request / step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .config import CacheConfig, ModelConfig, SchedulerConfig
from .errors import InvalidRequestError
from .model import ModelArchConfig, load_eos_token_ids, load_tokenizer
from .model_runner import ModelRunner, ModelRunnerOutput
from .outputs import EngineStats, RequestOutput
from .request import Request, RequestStatus
from .request_group import RequestGroup, SequenceState
from .sampler import Sampler, compute_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

_CONFIG_FIELDS: dict[type, tuple[str, ...]] = {
    ModelConfig: ("dtype", "device", "seed"),
    CacheConfig: (
        "block_size",
        "num_blocks",
        "kv_cache_memory_bytes",
        "gpu_memory_utilization",
        "enable_prefix_caching",
    ),
    SchedulerConfig: ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_waiting"),
}
_MAX_SEED = 2**63 - 1

FaultInjector = Callable[[SchedulerOutput], None]


class LLMEngine:
    """Paged-KV-cache generation over a Llama-family model; `step()` runs one scheduled forward."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ):
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.tokenizer = load_tokenizer(model_config.model)
        self.runner = ModelRunner(model_config, cache_config, scheduler_config)
        arch: ModelArchConfig = self.runner.arch
        self.vocab_size = arch.vocab_size
        self.eos_token_ids: set[int] = load_eos_token_ids(model_config.model, arch, self.tokenizer)
        self.scheduler = Scheduler(scheduler_config, cache_config, self.runner.num_blocks)
        self.sampler = Sampler(self.eos_token_ids)
        # Test hook: called with the SchedulerOutput before each forward; raising fails that step's requests.
        self.fault_injector: FaultInjector | None = None
        self._groups: dict[str, RequestGroup] = {}
        self._seq_of: dict[str, tuple[RequestGroup, SequenceState]] = {}
        self._to_report: dict[str, RequestGroup] = {}
        self._id_counter = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> LLMEngine:
        """Load a Hugging Face model folder; kwargs are ModelConfig/CacheConfig/SchedulerConfig fields."""
        known = {name for names in _CONFIG_FIELDS.values() for name in names}
        for key in kwargs:
            if key not in known:
                raise InvalidRequestError(
                    f"unknown engine option {key!r}; allowed: {', '.join(sorted(known))}", key
                )
        if "max_model_len" not in kwargs:
            kwargs["max_model_len"] = ModelArchConfig.from_pretrained(model).max_position_embeddings
        configs = {
            cls_: cls_(**{k: v for k, v in kwargs.items() if k in names})
            for cls_, names in _CONFIG_FIELDS.items()
            if cls_ is not ModelConfig
        }
        model_config = ModelConfig(
            model=str(model), **{k: v for k, v in kwargs.items() if k in _CONFIG_FIELDS[ModelConfig]}
        )
        return cls(model_config, configs[CacheConfig], configs[SchedulerConfig])

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; bad input raises InvalidRequestError naming the field."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if request_id in self._groups:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}", "sampling_parameters"
            )
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        if params.beam_width > 1:
            raise InvalidRequestError("beam search (beam_width > 1) is not supported yet", "beam_width")
        salt = None
        if params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position, so such a request never hits the cache.
            salt = f"prompt-logprobs-{uuid.uuid4().hex}"
        request = Request(
            request_id, token_ids, params, arrival_time=arrival_time, cache_salt=salt, group_id=request_id
        )
        self.scheduler.add_request(request)
        group = RequestGroup(request_id, prompt, params, self._new_sequence(0, request))
        self._groups[request_id] = group
        self._seq_of[request_id] = (group, group.seqs[0])

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids, from the ids when given, else by tokenizing the text."""
        if prompt_token_ids is not None:
            if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
                raise InvalidRequestError(
                    "prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids"
                )
            for tok in prompt_token_ids:
                if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                    raise InvalidRequestError(
                        f"prompt_token_ids entries must be integers in [0, {self.vocab_size}), got {tok!r}",
                        "prompt_token_ids",
                    )
            return list(prompt_token_ids)
        if prompt is None:
            raise InvalidRequestError("one of prompt or prompt_token_ids is required", "prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        token_ids = self.tokenizer.encode(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt tokenizes to no tokens", "prompt")
        return token_ids

    def _new_sequence(self, index: int, request: Request) -> SequenceState:
        return SequenceState(index, request, self.tokenizer, request.sampling_params)

    def abort_request(self, request_id: str) -> None:
        """Abort a user request (all its sequences); its final output comes from the next step()."""
        group = self._groups.get(request_id)
        if group is None:
            return
        ids = [s.request.request_id for s in group.seqs if s.finish_reason is None]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        group.num_pending_forks = 0
        for seq in group.seqs:
            if seq.finish_reason is None:
                seq.finish(RequestStatus.FINISHED_ABORTED)
        self._to_report[request_id] = group

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running, or has a final output not yet returned."""
        return bool(self._groups)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward; one output per user request that got tokens or finished."""
        sched = self.scheduler.schedule()
        if sched.scheduled:
            try:
                if self.fault_injector is not None:
                    self.fault_injector(sched)
                runner_out = self.runner.execute(sched)
                self._process(sched, runner_out)
            except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
                logger.exception("step failed; ending its %d requests with an error", len(sched.scheduled))
                self._fail_step(sched, f"{type(exc).__name__}: {exc}")
        else:
            self.scheduler.update_from_output(sched, {})
        return self._collect_outputs()

    def _process(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Sample, advance the scheduler, fork n>1 children, then apply stop conditions."""
        self._record_prompt_logprobs(runner_out)
        seqs = [self._seq_of[rid] for rid in runner_out.sample_request_ids]
        rows = list(range(len(seqs)))
        requests = [seq.request for _, seq in seqs]
        children: list[tuple[RequestGroup, Request]] = []
        for row, (group, seq) in enumerate(seqs):
            if group.num_pending_forks and seq.index == 0:
                for child in self._make_children(group):
                    children.append((group, child))
                    requests.append(child)
                    rows.append(row)
        logits = runner_out.sample_logits
        if len(rows) != logits.shape[0]:
            logits = logits[rows]
        sampled = self.sampler(logits, requests)
        tokens = dict(zip((r.request_id for r in requests), sampled.token_ids, strict=True))
        self.scheduler.update_from_output(sched, tokens)
        for group, child in children:
            self.scheduler.fork_request(group.seqs[0].request.request_id, child)
            child.append_output_token_id(tokens[child.request_id])
            seq = self._new_sequence(len(group.seqs), child)
            group.seqs.append(seq)
            group.num_pending_forks -= 1
            self._seq_of[child.request_id] = (group, seq)
        finished: dict[RequestStatus, list[str]] = {}
        for i, request in enumerate(requests):
            group, seq = self._seq_of[request.request_id]
            if seq.index == 0 and request.num_output_tokens == 1:
                self._prompt_tokens += request.num_prompt_tokens
            self._generation_tokens += 1
            seq.add_token(sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
            status = self._check_stop(seq)
            if status is not None:
                seq.finish(status)
                finished.setdefault(status, []).append(request.request_id)
            self._to_report[group.request_id] = group
        for status, ids in finished.items():
            self.scheduler.finish_requests(ids, status)

    def _make_children(self, group: RequestGroup) -> list[Request]:
        """The n-1 sibling Requests of a group whose prompt is now computed; seeds are offset per index."""
        parent = group.seqs[0].request
        children = []
        for index in range(1, 1 + group.num_pending_forks):
            params = group.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + index) % _MAX_SEED)
            children.append(
                Request(
                    f"{group.request_id}#{index}", parent.prompt_token_ids, params, group_id=group.request_id
                )
            )
        return children

    def _record_prompt_logprobs(self, runner_out: ModelRunnerOutput) -> None:
        """Fill prompt logprobs for the prompt rows this step computed."""
        for rid, (start, logits) in runner_out.prompt_logits.items():
            group, seq = self._seq_of[rid]
            if group.prompt_logprobs is None:
                continue
            prompt = seq.request.prompt_token_ids
            targets = prompt[start + 1 : start + 1 + logits.shape[0]]
            _, tops = compute_logprobs(logits, targets, group.params.prompt_logprobs or 0)
            group.prompt_logprobs[start + 1 : start + 1 + len(tops)] = tops

    def _check_stop(self, seq: SequenceState) -> RequestStatus | None:
        """Why this sequence stops after its newest token, if it does: stop string, eos, stop id, length."""
        request = seq.request
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if seq.stop_reason is not None:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.scheduler_config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail_step(self, sched: SchedulerOutput, error: str) -> None:
        """End every user request with a sequence in this step with finish_reason "error"."""
        groups = {
            self._seq_of[s.request.request_id][0].request_id: self._seq_of[s.request.request_id][0]
            for s in sched.scheduled
        }
        for group in groups.values():
            ids = [s.request.request_id for s in group.seqs if s.finish_reason is None]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            group.num_pending_forks = 0
            group.error = error
            for seq in group.seqs:
                if seq.finish_reason is None:
                    seq.finish(RequestStatus.FINISHED_ERROR)
            self._to_report[group.request_id] = group
        self.scheduler.update_from_output(sched, {})

    def _collect_outputs(self) -> list[RequestOutput]:
        """Outputs of the groups touched since the last step; finished groups are forgotten."""
        outputs = []
        for group in self._to_report.values():
            out = group.output()
            outputs.append(out)
            if out.finished:
                self._forget(group)
        self._to_report.clear()
        return outputs

    def _forget(self, group: RequestGroup) -> None:
        del self._groups[group.request_id]
        for seq in group.seqs:
            self._seq_of.pop(seq.request.request_id, None)
            self.sampler.free(seq.request.request_id)

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
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"generate-{next(self._id_counter)}"
            if isinstance(prompt, str):
                self.add_request(rid, prompt, p)
            else:
                self.add_request(rid, None, p, prompt_token_ids=list(prompt))
            ids.append(rid)
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
        )
