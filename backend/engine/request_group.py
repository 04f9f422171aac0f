"""Engine-side state of a user request: its returned sequences, their text, logprobs and finish reasons."""

from __future__ import annotations

from typing import Any

from pagedserve.backend.core.outputs import CompletionOutput, RequestOutput
from pagedserve.backend.core.request import FINISH_REASONS, Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.detokenizer import IncrementalDetokenizer


class SequenceState:
    """One returned sequence: its scheduler Request plus detokenizer, logprobs and what was reported."""

    def __init__(self, index: int, request: Request, tokenizer: Any, params: SamplingParams):
        self.index = index
        self.request = request
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


class RequestGroup:
    """A user request: its n sequences, the first one forked into the rest once the prompt is computed."""

    def __init__(self, request_id: str, prompt: str | None, params: SamplingParams, first: SequenceState):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.seqs = [first]
        self.num_pending_forks = params.n - 1
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * first.request.num_prompt_tokens
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        """True once every sequence, those still to be forked included, has finished."""
        return self.num_pending_forks == 0 and all(s.finish_reason is not None for s in self.seqs)

    def end(self, status: RequestStatus, error: str | None = None) -> list[str]:
        """Abort or fail: finish every unfinished sequence; returns their request ids."""
        self.num_pending_forks = 0
        self.error = error
        ids = []
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.finish(status)
                ids.append(seq.request.request_id)
        return ids

    def output(self) -> RequestOutput:
        """The RequestOutput for this moment."""
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
