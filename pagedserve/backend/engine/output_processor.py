"""OutputProcessor: token ids in, what clients get out. It holds the request groups (SamplingGroup, BeamGroup),
which claim each step's logits rows and record its tokens (detokenizing them), applies stop conditions and
timeouts, collects RequestOutputs and counts prompt and generation tokens. Sequences it ends are finished
in the scheduler; beam groups fork and drop their beams there."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from pagedserve.backend.core.errors import ErrorKind, RequestTimeoutError
from pagedserve.backend.core.outputs import RequestOutput
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.backend.engine.beam_search import BeamGroup
from pagedserve.backend.engine.core import CoreStep
from pagedserve.backend.engine.detokenizer import Tokenizer
from pagedserve.backend.engine.pooling import PoolingGroup, PoolingSupport
from pagedserve.backend.engine.request_group import RequestGroup, SamplingGroup, SequenceState, StepBatch
from pagedserve.backend.engine.spec_decode import Run, record_run
from pagedserve.backend.structured import StructuredOutputs
from pagedserve.backend.worker.model_runner import ModelRunnerOutput
from pagedserve.backend.worker.sampler import SamplerOutput

logger = logging.getLogger(__name__)


class Deadlines:
    """Requests' timeouts: a heap of (deadline, token, request id) and, by request id, (token, timeout in
    seconds) while the request lives; a heap entry whose token is not its request's any more is skipped."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._timeouts: dict[str, tuple[int, float]] = {}
        self._tokens = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def watch(self, request_id: str, deadline: float, timeout: float) -> None:
        token = next(self._tokens)
        self._timeouts[request_id] = (token, timeout)
        heapq.heappush(self._heap, (deadline, token, request_id))

    def expired(self, now: float) -> Iterator[tuple[str, float]]:
        """(request id, timeout) of each watched request whose deadline is not after `now`, taken off."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, token, request_id = heapq.heappop(heap)
            entry = self._timeouts.get(request_id)
            if entry is not None and entry[0] == token:
                yield request_id, entry[1]

    def forget(self, request_id: str) -> None:
        self._timeouts.pop(request_id, None)


class OutputProcessor:
    """The engine's user requests, from add to final output. `release` drops what the core keeps for a
    sequence once its request is forgotten; `eos_token_ids` is the engine's own set (changes show here)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], scheduler: Scheduler,
                 structured: StructuredOutputs, release: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.structured = structured
        self._release = release
        self._groups: dict[str, RequestGroup] = {}  # by user request id
        self._owner: dict[str, RequestGroup] = {}  # by scheduler request id: the group it belongs to
        self._to_report: dict[str, RequestGroup] = {}  # touched since the last outputs were collected
        self._error_kinds: dict[str, ErrorKind] = {}  # by user request id, for an error that is not INTERNAL
        self._deadlines = Deadlines()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt: str | None, request: Request, params: SamplingParams,
            grammar: Any = None, timeout: float | None = None) -> None:
        """Make the group of a queued request (`request` its first sequence; `grammar` a compiled structured
        output) and watch its `timeout` in seconds from its arrival."""
        group: RequestGroup
        if params.beam_width > 1:
            group = BeamGroup(request_id, prompt, request, params, self.eos_token_ids, self._decode)
        else:
            # An engine without a tokenizer has no structured outputs (nor requests that need them).
            new_matcher = None if self.structured is None else self.structured.sequence_matchers(
                grammar, params.reasoning_end_token_ids, params.thinking_token_budget)
            group = SamplingGroup(request_id, prompt, request, self.tokenizer, self._unused_id, new_matcher)
        self._groups[request_id] = self._owner[request_id] = group
        if timeout is not None:
            self._deadlines.watch(request_id, request.arrival_time + timeout, timeout)

    def add_pooling(self, request_id: str, prompt: str | None, request: Request, support: PoolingSupport,
                    timeout: float | None = None) -> None:
        """Make the group of a queued pooling request; its vector is finished the way `support` says."""
        self._groups[request_id] = self._owner[request_id] = PoolingGroup(request_id, prompt, request, support)
        if timeout is not None:
            self._deadlines.watch(request_id, request.arrival_time + timeout, timeout)

    def in_use(self, request_id: str) -> bool:
        """Whether a user request or a sequence holds this id."""
        return request_id in self._groups or request_id in self._owner

    def has_unfinished(self) -> bool:
        """True while any request is queued, running, or has a final output not yet collected."""
        return bool(self._groups)

    def abort(self, request_id: str) -> None:
        """Abort a user request (all its sequences); its final output comes with the next collect()."""
        group = self._groups.get(request_id)
        if group is not None and not group.finished:
            self._end_group(group, RequestStatus.FINISHED_ABORTED)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _unused_id(self, request_id: str) -> str:
        """`request_id`, suffixed until no user request or sequence holds it."""
        while self.in_use(request_id) or self.scheduler.get_request(request_id):
            request_id += "'"
        return request_id

    # ------------------------------------------------------------------ before and after a step

    def end_timed_out(self, now: float) -> None:
        """End every request whose timeout passed by `now` (time.monotonic()), waiting or running, with a
        TIMEOUT error; its blocks are freed before the next step is scheduled."""
        if not self._deadlines:
            return
        for request_id, timeout in self._deadlines.expired(now):
            group = self._groups.get(request_id)
            if group is None or group.finished:
                continue
            error = RequestTimeoutError(
                f"request timeout expired: the request did not finish within its timeout of {timeout:g} s"
            )
            self._end_group(group, RequestStatus.FINISHED_ERROR, str(error), ErrorKind.TIMEOUT)

    def release_stalled_beams(self) -> None:
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

    def fail_step(self, sched: SchedulerOutput, error: str) -> None:
        """End every user request with a sequence in this step with finish_reason "error"."""
        for item in sched.scheduled:
            group = self._groups.get(item.request.group_id or item.request.request_id)
            if group is not None and not group.finished:
                self._end_group(group, RequestStatus.FINISHED_ERROR, error)

    # ------------------------------------------------------------------ a step's rows and tokens

    def claim_rows(self, runner_out: ModelRunnerOutput) -> StepBatch:
        """Hand the forward's prompt logits to their groups; each group claims its sample rows."""
        for rid, (start, logits) in runner_out.prompt_logits.items():
            self._owner[rid].record_prompt_logits(rid, start, logits)
        batch = StepBatch()
        for row, rid in enumerate(runner_out.sample_request_ids):
            self._owner[rid].take_logits(rid, row, runner_out.sample_logits[row], batch)
        return batch

    def process(self, step: CoreStep) -> None:
        """Record a step's tokens: forked children join their groups, each sampled token (a speculating
        sequence's verified run) is recorded until a stop condition ends its sequence, beam groups advance."""
        batch = step.batch
        for group, _, child in batch.forks:
            group.adopt(child)
            self._owner[child.request_id] = group
        if step.sample is not None:
            self._apply_tokens(batch, step.sample.sampled, step.sample.runs)
        for beam in batch.ready_beams.values():
            self._advance_beam(beam)
        for request_id, vector in step.pooled.items():  # the core finished them in the scheduler
            group = self._owner[request_id]
            group.record_pooled(vector)
            self.prompt_tokens += group.request.num_prompt_tokens
            self._to_report[group.request_id] = group

    def _apply_tokens(self, batch: StepBatch, sampled: SamplerOutput, runs: dict[str, Run]) -> None:
        """Record each sampled token and finish the sequences they stop; a run's tokens after the one that
        stops it are dropped."""
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
            self.prompt_tokens += request.num_prompt_tokens
        self.generation_tokens += 1
        stop_token = self._is_stop_token(request, token)
        # As in vLLM, the text of an eos or stop token is not output unless include_stop_str_in_output.
        text = request.sampling_params.include_stop_str_in_output or not stop_token
        seq.add_token(token, logprob, top, text=text)
        return self._check_stop(seq, stop_token)

    def _advance_beam(self, beam: BeamGroup) -> None:
        """One beam-search step for a group whose live beams all have their logits."""
        if beam.live[0].num_output_tokens == 0:
            self.prompt_tokens += beam.live[0].num_prompt_tokens
        dropped = beam.advance(self.scheduler)
        self.scheduler.finish_requests(dropped, RequestStatus.FINISHED_STOPPED)
        for rid in dropped:
            self._owner.pop(rid, None)
        for request in beam.live:
            self._owner[request.request_id] = beam
        if beam.finished:
            self._to_report[beam.request_id] = beam
        else:
            self.generation_tokens += len(beam.live)

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
            or request.num_tokens >= self.scheduler.config.max_model_len
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

    # ------------------------------------------------------------------ outputs

    def _end_group(
        self, group: RequestGroup, status: RequestStatus, error: str | None = None,
        error_kind: ErrorKind = ErrorKind.INTERNAL,
    ) -> None:
        """Abort or fail every unfinished sequence of a user request; it reports on the next collect()."""
        self.scheduler.finish_requests(group.end(status, error), status)
        if error is not None and error_kind is not ErrorKind.INTERNAL:
            self._error_kinds[group.request_id] = error_kind
        self._to_report[group.request_id] = group

    def collect(self) -> list[RequestOutput]:
        """Outputs of the groups touched since the last collect; finished groups are forgotten."""
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
        self._deadlines.forget(group.request_id)
        for request_id in group.sequence_ids():
            self._owner.pop(request_id, None)
            self._release(request_id)
