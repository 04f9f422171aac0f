"""N-gram (prompt-lookup) speculative decoding, exact for greedy and sampled requests: drafts come from each
sequence's own tokens, the target model scores all of them in the step's one forward, and verify.py keeps
the longest run the target's own sampling agrees with, plus its next token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedserve.backend.core.config import SpeculativeConfig
from pagedserve.backend.core.request import Request, RequestStatus


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
    """Whether a sequence may get drafts: any sampled or greedy one past its first output token (before it,
    n > 1 forks its siblings from the row), but not a beam (beam search runs without speculation)."""
    return request.sampling_params.beam_width == 1 and request.num_output_tokens >= 1


class NgramSpeculator:
    """Proposes drafts before each schedule() (verify.py samples them); counts them with vLLM's names."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens  # drafts accepted at position i

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of each running, decoding request that can speculate (maybe to []); none
        while `disable_by_batch_size` or more requests run."""
        cfg = self.config
        disabled = cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size
        for request in running:
            request.spec_token_ids = []
            if disabled:
                continue
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

    def count(self, num_drafts: dict[str, int], num_accepted: dict[str, int]) -> None:
        """Add one step's verified drafts (scheduled draft count and accepted count by request id)."""
        for rid, k in num_drafts.items():
            n = num_accepted[rid]
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += n
            for i in range(n):
                self.accepted_per_pos[i] += 1

    def observe(self, sched: Any) -> None:
        """Nothing: n-gram drafts need nothing of the step the target ran (a draft model does)."""

    def stats(self) -> dict[str, Any]:
        """Running totals with vLLM's names (less the `vllm:spec_decode_` prefix and `_total` suffix);
        the per-position counts by position, 0 first."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
