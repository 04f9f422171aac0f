"""The per-step attention metadata every attention layer reads; passed explicitly, never global."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each flat token's K/V goes and which cached blocks each sequence attends over.

    Sequence s owns query rows cu_seqlens_q[s]:cu_seqlens_q[s+1]; its context after this step is
    seq_lens[s] tokens, stored in the blocks block_tables[s, :ceil(seq_lens[s] / block_size)].
    bidirectional_ranges (Gemma 3's images): row t = [lo, hi), the key positions of token t's own sequence it
    sees beside its causal ones (an image's tokens see each other both ways); [0, 0) for text and decode tokens,
    None when no token of the step has a range.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    max_seqlen_q: int
    max_seqlen_k: int
    bidirectional_ranges: torch.Tensor | None = None  # [T, 2] int32

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the step."""
        return self.seq_lens.numel()
