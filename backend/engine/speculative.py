"""N-gram (prompt-lookup) speculative decoding, greedy and exact: drafts come from each sequence's own
tokens, the target model scores all of them in the step's one forward, and the longest prefix equal to the
target's argmax is kept, plus the target's own next token. Sampled requests are not speculated yet."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from pagedserve.backend.core.config import SpeculativeConfig
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.scheduler import SchedulerOutput
from pagedserve.backend.engine.request_group import SequenceState
from pagedserve.backend.worker.sampler import SamplerOutput

# A verified run of one sequence: (token id, its logprob, top logprobs), in output order.
Run = list[tuple[int, float, None]]


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    of length in [min_n, max_n]; [] when no such suffix occurred before."""
    # tokens: [L] int64
    last = len(tokens) - 1
    if last < min_n or k < 1:
        return []
    ends = np.arange(last)  # where an earlier occurrence of the suffix may end
    alive = np.ones(last, dtype=bool)
    lengths = np.zeros(last, dtype=np.int64)
    for j in range(min(max_n, last)):
        back = ends - j
        alive &= (back >= 0) & (tokens[np.maximum(back, 0)] == tokens[last - j])
        if not alive.any():
            break
        lengths += alive
    longest = int(lengths.max())
    if longest < min_n:
        return []
    end = int(np.flatnonzero(lengths == longest)[-1])
    return tokens[end + 1 : end + 1 + k].tolist()


def can_speculate(request: Request) -> bool:
    """Whether the target's next token is the raw argmax of its logits at every position, so greedy
    verification is exact: greedy, one sequence, nothing that edits logits or asks for logprobs."""
    p = request.sampling_params
    return (
        p.is_greedy
        and p.n == 1
        and p.beam_width == 1
        and p.logprobs is None
        and p.prompt_logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not p.structured_outputs
        and not (p.allowed_token_ids or p.bad_words_token_ids or p.logit_bias)
        and request.num_output_tokens >= p.min_tokens
    )


class NgramSpeculator:
    """Proposes drafts before each schedule() and verifies them after the forward; counts them."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of each running, decoding request that can speculate (maybe to [])."""
        cfg = self.config
        for request in running:
            if request.status != RequestStatus.RUNNING or request.num_tokens - request.num_computed_tokens != 1:
                continue
            if not can_speculate(request):
                continue
            # Room for the drafts plus the target's own token within max_tokens and max_model_len.
            room = min(
                request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens
            ) - 1
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            request.spec_token_ids = ngram_lookup(
                tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, min(cfg.num_speculative_tokens, room)
            )

    def verify(
        self, sched: SchedulerOutput, spec_logits: dict[str, torch.Tensor], requests: Sequence[Request],
        sampled: SamplerOutput, tokens: dict[str, int],
    ) -> tuple[dict[str, int], dict[str, Run]]:
        """Greedy verification of every scheduled draft: returns (accepted drafts, run) by request id and
        sets `tokens[request_id]` to the run's last token (the target's correction, or its bonus token)."""
        items = [
            s for s in sched.scheduled if s.spec_token_ids and s.request.request_id in spec_logits
            and s.request.request_id in tokens
        ]
        if not items:
            return {}, {}
        logits = torch.cat([spec_logits[s.request.request_id] for s in items]).float()  # [sum k, V]
        best, targets = logits.max(dim=-1)
        logprobs = (best - torch.logsumexp(logits, dim=-1)).tolist()
        targets_list = targets.tolist()
        row_of = {r.request_id: i for i, r in enumerate(requests)}
        num_accepted: dict[str, int] = {}
        runs: dict[str, Run] = {}
        offset = 0
        for item in items:
            rid, drafts = item.request.request_id, item.spec_token_ids
            k = len(drafts)
            want = targets_list[offset : offset + k]
            n = next((i for i in range(k) if drafts[i] != want[i]), k)
            run: Run = [(want[i], logprobs[offset + i], None) for i in range(min(n + 1, k))]
            if n == k:
                run.append((tokens[rid], sampled.logprobs[row_of[rid]], None))
            tokens[rid] = run[-1][0]
            num_accepted[rid], runs[rid] = n, run
            offset += k
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += n
        return num_accepted, runs

    def stats(self) -> dict[str, int]:
        """Running totals with vLLM's names (less the `vllm:spec_decode_` prefix and `_total` suffix)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }


def record_run(
    seq: SequenceState, run: Run, record: Callable[[SequenceState, int, float, None], RequestStatus | None]
) -> RequestStatus | None:
    """Record a verified run token by token, as if each had been sampled alone; stop where one stops it
    (the tokens after it are dropped). The scheduler appended the whole run, so it is taken off first."""
    request = seq.request
    del request.output_token_ids[-len(run) :], request.all_token_ids[-len(run) :]
    for token, logprob, top in run:
        request.append_output_token_id(token)
        status = record(seq, token, logprob, top)
        if status is not None:
            return status
    return None
