"""Engine-side state of a user request. `RequestGroup` is what the engine steps: one user request over one
or more scheduler Requests. `SamplingGroup` samples n sequences (the first forks into the rest once the
prompt is computed); `BeamGroup` (beam_search.py) runs beam search. The engine sees only this interface."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.backend.core.outputs import CompletionOutput, RequestOutput
from pagedserve.backend.core.request import FINISH_REASONS, Request, RequestStatus
from pagedserve.backend.core.sampling_params import MAX_SEED, SamplingParams
from pagedserve.backend.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from pagedserve.backend.worker.sampler import compute_logprobs

if TYPE_CHECKING:
    from pagedserve.backend.engine.beam_search import BeamGroup


@dataclass
class StepBatch:
    """What one step's sample rows ask for, gathered from their groups in row order."""

    rows: list[int] = field(default_factory=list)  # logits rows to sample, one per request below
    requests: list[Request] = field(default_factory=list)
    groups: list[SamplingGroup | None] = field(default_factory=list)  # each request's group (None: none)
    matchers: list[Any] = field(default_factory=list)  # the grammar matcher that masks each row, or None
    # (group, parent, child): a child sampled from its parent's row, forked from it once the row is sampled
    forks: list[tuple[SamplingGroup, Request, Request]] = field(default_factory=list)
    ready_beams: dict[str, BeamGroup] = field(default_factory=dict)  # beam groups whose beams all have logits

    def sample(self, row: int, group: SamplingGroup | None, request: Request, matcher: Any = None) -> None:
        self.rows.append(row)
        self.requests.append(request)
        self.groups.append(group)
        self.matchers.append(matcher)


class RequestGroup(ABC):
    """One user request as the engine steps it."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    arrival_time: float

    @property
    @abstractmethod
    def finished(self) -> bool:
        """True once nothing of it runs any more."""

    @abstractmethod
    def sequence_ids(self) -> list[str]:
        """The scheduler request ids it holds now."""

    @abstractmethod
    def take_logits(self, request_id: str, row: int, logits: torch.Tensor, batch: StepBatch) -> None:
        """Claim sample row `row` (next-token logits [V] of `request_id`) for this step."""

    @abstractmethod
    def end(self, status: RequestStatus, error: str | None = None) -> list[str]:
        """Abort or fail: finish what still runs; returns the scheduler request ids to finish."""

    @abstractmethod
    def output(self) -> RequestOutput:
        """The RequestOutput for this moment."""

    @abstractmethod
    def record_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
        """Prompt logits [k, V] of `request_id`, scoring prompt tokens start+1 ..."""

    def stalled_running(self) -> list[Request]:
        """Its running Requests that wait on siblings (holding blocks with nothing to compute)."""
        return []


class SequenceState:
    """One returned sequence: its scheduler Request plus detokenizer, logprobs and what was reported."""

    def __init__(self, index: int, request: Request, tokenizer: Tokenizer, params: SamplingParams,
                 matcher: Any = None):
        self.index = index
        self.request = request
        self.matcher = matcher  # xgrammar GrammarMatcher of a structured output, advanced token by token
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop if params.min_tokens == 0 else (),
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self._stop_strings = params.stop
        self._min_tokens = params.min_tokens
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self._num_reported_tokens = 0

    def add_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None,
                  text: bool = True) -> None:
        """Record a token already appended to the Request: logprobs, text (unless `text` is false: a stop
        token), and a stop string it completes."""
        self.cumulative_logprob += logprob
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)  # masked sampling only draws tokens the grammar allows
        if self.logprobs is not None:
            self.logprobs.append(top_logprobs if top_logprobs is not None else {token_id: logprob})
        if self._min_tokens and self.request.num_output_tokens == self._min_tokens:
            # Stop strings count only from min_tokens on (as in vLLM); earlier text is never searched.
            self.detokenizer.watch_stop_strings(self._stop_strings)
        if not text:
            return
        stop = self.detokenizer.update([token_id])
        if stop is not None:
            self.stop_reason = stop

    def finish(self, status: RequestStatus) -> None:
        """Mark finished; the detokenizer releases any text it held back."""
        self.finish_reason = FINISH_REASONS[status]
        self.detokenizer.finish()

    def completion(self) -> CompletionOutput:
        """This sequence now; deltas cover what is new since the previous call."""
        tokens = self.request.output_token_ids
        new_tokens = tokens[self._num_reported_tokens :]
        self._num_reported_tokens = len(tokens)
        delta = self.detokenizer.get_delta()
        self.text += delta
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(tokens),
            text_delta=delta,
            token_ids_delta=list(new_tokens),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class SamplingGroup(RequestGroup):
    """A user request of n sampled sequences, the first one forked into the rest once the prompt is computed.

    `unused_id` turns a wanted child id into one no request holds (the engine knows which are taken);
    `new_matcher`, for a structured output, makes each sequence's grammar matcher."""

    def __init__(self, request_id: str, prompt: str | None, first: Request, tokenizer: Tokenizer,
                 unused_id: Callable[[str], str], new_matcher: Callable[[], Any] | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.params = first.sampling_params
        self.arrival_time = first.arrival_time
        self._tokenizer = tokenizer
        self._unused_id = unused_id
        self._new_matcher = new_matcher
        self.seqs = [SequenceState(0, first, tokenizer, self.params, self._matcher())]
        self._by_id = {first.request_id: self.seqs[0]}
        self.num_pending_forks = self.params.n - 1
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * first.num_prompt_tokens
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        """True once every sequence, those still to be forked included, has finished."""
        return self.num_pending_forks == 0 and all(s.finish_reason is not None for s in self.seqs)

    def sequence_ids(self) -> list[str]:
        return [seq.request.request_id for seq in self.seqs]

    def sequence(self, request_id: str) -> SequenceState:
        return self._by_id[request_id]

    def take_logits(self, request_id: str, row: int, logits: torch.Tensor, batch: StepBatch) -> None:
        seq = self._by_id[request_id]
        batch.sample(row, self, seq.request, seq.matcher)
        if self.num_pending_forks and seq.index == 0:
            # The children sample from the parent's row: same prompt, same next-token distribution, and
            # (no token accepted yet) the same grammar state.
            for child in self._children():
                batch.forks.append((self, seq.request, child))
                batch.sample(row, self, child, seq.matcher)

    def _matcher(self) -> Any:
        return self._new_matcher() if self._new_matcher is not None else None

    def _children(self) -> list[Request]:
        """The n-1 sibling Requests, once the prompt is computed; seeds are offset per index."""
        parent = self.seqs[0].request
        children = []
        for index in range(1, 1 + self.num_pending_forks):
            params = self.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + index) % MAX_SEED)
            child_id = self._unused_id(f"{self.request_id}#{index}")
            children.append(Request(child_id, parent.prompt_token_ids, params, group_id=self.request_id))
        return children

    def adopt(self, child: Request) -> SequenceState:
        """A forked child becomes the next sequence."""
        seq = SequenceState(len(self.seqs), child, self._tokenizer, child.sampling_params, self._matcher())
        self.seqs.append(seq)
        self._by_id[child.request_id] = seq
        self.num_pending_forks -= 1
        return seq

    def record_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
        if self.prompt_logprobs is None:
            return
        prompt = self.seqs[0].request.prompt_token_ids
        targets = prompt[start + 1 : start + 1 + logits.shape[0]]
        _, tops = compute_logprobs(logits, targets, self.params.prompt_logprobs or 0)
        self.prompt_logprobs[start + 1 : start + 1 + len(tops)] = tops

    def end(self, status: RequestStatus, error: str | None = None) -> list[str]:
        self.num_pending_forks = 0
        self.error = error
        ids = []
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.finish(status)
                ids.append(seq.request.request_id)
        return ids

    def output(self) -> RequestOutput:
        first = self.seqs[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=[s.completion() for s in self.seqs],
            finished=self.finished,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=self.error,
        )
