"""Beam search as transformers runs it (top 2W continuations, finished hypotheses with length penalty).

`BeamSearch` is the pure bookkeeping; `BeamGroup` ties it to scheduler Requests that share KV blocks
through fork (copy-on-write). Beams stay in step: a beam whose logits arrived waits, holding its blocks
with no token to compute, until every live beam of the group has its logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.backend.core.outputs import CompletionOutput, RequestOutput
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler
from pagedserve.backend.engine.request_group import RequestGroup, StepBatch


@dataclass(slots=True)
class BeamCandidate:
    """A continuation: parent beam index, its new token, the cumulative logprob after it."""

    parent: int
    token_id: int
    score: float


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its tokens, raw cumulative logprob, and the length-penalised score it ranks by."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float


class BeamSearch:
    """Selection logic of transformers' `_beam_search` (early_stopping=False) for one prompt."""

    def __init__(
        self, width: int, length_penalty: float, eos_token_ids: set[int], max_tokens: int, min_tokens: int
    ):
        self.width = width
        self.length_penalty = length_penalty
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.finished: list[Hypothesis] = []
        self._improvable = True

    def step(
        self, beams: list[list[int]], scores: list[float], log_probs: torch.Tensor, num_generated: int
    ) -> tuple[list[BeamCandidate], bool]:
        """Given each live beam's output tokens, score and next-token log_probs [B, V], pick the next beams.

        Returns (the running beams for the next step, whether the search is over).
        """
        log_probs = log_probs.float()
        vocab = log_probs.shape[1]
        # Stop ids outside the vocabulary can never be drawn (the sampler ignores them the same way).
        banned = sorted(t for t in self.eos_token_ids if t < vocab)
        if num_generated < self.min_tokens and banned:
            log_probs = log_probs.clone()
            log_probs[:, banned] = -float("inf")
        total = (
            log_probs + torch.tensor(scores, dtype=torch.float32, device=log_probs.device)[:, None]
        ).reshape(-1)
        keep = min(max(2, 1 + len(self.eos_token_ids)) * self.width, total.numel())
        top_scores, top_ids = torch.topk(total, keep)
        length = num_generated + 1
        running: list[BeamCandidate] = []
        new_finished: list[Hypothesis] = []
        for rank, (score, flat) in enumerate(zip(top_scores.tolist(), top_ids.tolist(), strict=True)):
            cand = BeamCandidate(flat // vocab, flat % vocab, score)
            if cand.token_id in self.eos_token_ids or length >= self.max_tokens:
                if rank < self.width and self._improvable:
                    tokens = [*beams[cand.parent], cand.token_id]
                    new_finished.append(Hypothesis(tokens, score, score / length**self.length_penalty))
            elif len(running) < self.width:
                running.append(cand)
        merged = self.finished + new_finished
        self.finished = sorted(merged, key=lambda h: h.score, reverse=True)[: self.width]
        if len(self.finished) == self.width and running:
            best_possible = running[0].score / length**self.length_penalty
            self._improvable = self._improvable and best_possible > self.finished[-1].score
        return running, not (running and self._improvable)


class BeamGroup(RequestGroup):
    """A user request decoded by beam search; returns its best `n` hypotheses once, at the end."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        first: Request,
        params: SamplingParams,
        eos_token_ids: set[int],
        detokenize: Callable[[list[int], bool], str],
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.prompt_token_ids = list(first.prompt_token_ids)
        self.arrival_time = first.arrival_time
        eos = set() if params.ignore_eos else set(eos_token_ids)
        eos |= set(params.stop_token_ids)
        self.search = BeamSearch(
            params.beam_width, params.length_penalty, eos, first.max_tokens or 1, params.min_tokens
        )
        self.live: list[Request] = [first]
        self.scores: list[float] = [0.0]
        self._rows: dict[str, torch.Tensor] = {}
        self._detokenize = detokenize
        self._num_forks = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        """True once the search ended (or the request was aborted or failed)."""
        return self.finish_reason is not None

    def sequence_ids(self) -> list[str]:
        return [r.request_id for r in self.live]

    def take_logits(self, request_id: str, row: int, logits: torch.Tensor, batch: StepBatch) -> None:
        """Store a beam's next-token logits [V]; the group is ready once every live beam has them."""
        self._rows[request_id] = torch.log_softmax(logits.float(), dim=-1)
        if all(r.request_id in self._rows for r in self.live):
            batch.ready_beams[self.request_id] = self

    def record_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
        """Never called: prompt logprobs are refused with beam search (input_processing.check_params)."""

    def stalled_running(self) -> list[Request]:
        return [r for r in self.live if r.status == RequestStatus.RUNNING]

    def advance(self, scheduler: Scheduler) -> list[str]:
        """Run one beam step over the stored logits: fork, extend and drop beams through the scheduler.

        Returns the request ids of beams that ended (the caller finishes them in the scheduler).
        """
        first = self.live[0]
        if self.num_cached_tokens == 0:
            self.num_cached_tokens = max(first.num_cached_tokens, 0)
        rows = torch.stack([self._rows.pop(r.request_id) for r in self.live])
        beams = [list(r.output_token_ids) for r in self.live]
        running, done = self.search.step(beams, self.scores, rows, first.num_output_tokens)
        if done:
            self.finish_reason = "done"
            return [r.request_id for r in self.live]
        used: set[int] = set()
        new_live: list[Request] = []
        for cand in running:
            parent = self.live[cand.parent]
            if cand.parent in used:
                new_live.append(self._fork(scheduler, parent))
            else:
                used.add(cand.parent)
                new_live.append(parent)
        # Forks above copied the parents' tokens; only now may the parents take their own new token.
        for request, cand in zip(new_live, running, strict=True):
            request.append_output_token_id(cand.token_id)
        dropped = [r.request_id for i, r in enumerate(self.live) if i not in used]
        self.live = new_live
        self.scores = [c.score for c in running]
        return dropped

    def _fork(self, scheduler: Scheduler, parent: Request) -> Request:
        """A new beam sharing the parent's blocks; the copy of a parent whose KV is incomplete (preempted) recomputes."""
        self._num_forks += 1
        child_id = f"{self.request_id}#beam{self._num_forks}"
        while scheduler.get_request(child_id) is not None:
            child_id += "'"
        child = Request(
            child_id,
            parent.prompt_token_ids,
            parent.sampling_params,
            arrival_time=parent.arrival_time,
            group_id=self.request_id,
            priority=parent.priority,
            mm_inputs=parent.mm_inputs,  # a beam that recomputes its prompt needs its images
        )
        if parent.status == RequestStatus.RUNNING and parent.num_computed_tokens == parent.num_tokens:
            scheduler.fork_request(parent.request_id, child)
        else:
            for token in parent.output_token_ids:
                child.append_output_token_id(token)
            child.max_tokens = parent.max_tokens
            scheduler.requeue(child)
        return child

    def end(self, status: RequestStatus, error: str | None = None) -> list[str]:
        """Abort or fail the search; returns the live request ids to finish."""
        self.finish_reason = "abort" if status == RequestStatus.FINISHED_ABORTED else "error"
        self.error = error
        return [r.request_id for r in self.live]

    def output(self) -> RequestOutput:
        """The best n hypotheses (final), or the live beams so far when aborted or failed."""
        if self.finish_reason == "done":
            chosen = [(h.token_ids, h.cumulative_logprob) for h in self.search.finished[: self.params.n]]
        else:
            chosen = [(list(r.output_token_ids), s) for r, s in zip(self.live, self.scores, strict=True)]
            chosen = chosen[: self.params.n]
        eos = self.search.eos_token_ids
        outputs = []
        for index, (tokens, cumulative) in enumerate(chosen):
            if self.finish_reason != "done":
                reason = self.finish_reason
            else:
                reason = "stop" if tokens and tokens[-1] in eos else "length"
            text = self._detokenize(tokens, self.params.skip_special_tokens)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=tokens,
                    text_delta=text,
                    token_ids_delta=list(tokens),
                    cumulative_logprob=cumulative,
                    finish_reason=reason,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=True,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )
