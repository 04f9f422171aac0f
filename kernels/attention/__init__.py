"""Paged attention: causal attention of each sequence's new queries over its K/V in the paged cache."""

from __future__ import annotations

from types import ModuleType

import torch
from pagedserve.kernels.attention import cpu, reference
from pagedserve.kernels.dispatch import Implementations


def _load_triton() -> ModuleType:
    from pagedserve.kernels.attention import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's tokens
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:
    """Causal attention over the paged cache; query i of sequence s sits at seq_lens[s] - q_len_s + i."""
    return _IMPLEMENTATIONS.select(query).paged_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k, out
    )
