"""Paged attention: causal attention of each sequence's new queries over its K/V in the paged cache."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels import kv8
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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    bidirectional_ranges: torch.Tensor | None = None,  # [T, 2] int32
) -> torch.Tensor:
    """Causal attention over the paged cache; query i of sequence s sits at seq_lens[s] - q_len_s + i.

    sliding_window: that query sees only keys at positions p with pos - sliding_window < p <= pos
    (transformers' sliding-window mask). logits_soft_cap: scores become cap * tanh(score / cap) (Gemma 2).
    k_scale, v_scale: an fp8 cache holds K / k_scale and V / v_scale (kernels.kv8); ignored otherwise.
    bidirectional_ranges: row t = [lo, hi), keys of token t's sequence it sees beside its causal ones (Gemma 3's
    image runs; hi <= that sequence's seq_len, [0, 0) for none): visible(t, p) = (p <= pos_t or lo_t <= p < hi_t)
    and p > pos_t - sliding_window. Served by a module that declares SUPPORTS_BIDIRECTIONAL, else the reference.
    """
    module, extra = kv8.route(_IMPLEMENTATIONS.select(query), reference, key_cache, k_scale, v_scale)
    if bidirectional_ranges is not None:
        _check_ranges(bidirectional_ranges, query)
        if not getattr(module, "SUPPORTS_BIDIRECTIONAL", False):
            module = reference
        extra["bidirectional_ranges"] = bidirectional_ranges
    if sliding_window is None and logits_soft_cap is None:
        return module.paged_attention(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k,
            out, **extra,
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1; got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive; got {logits_soft_cap}")
    return module.paged_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q, max_seqlen_k,
        out, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, **extra,
    )


def _check_ranges(ranges: torch.Tensor, query: torch.Tensor) -> None:
    """bidirectional_ranges must be one integer [lo, hi) row per query token, on the query's device."""
    if ranges.dim() != 2 or ranges.shape != (query.shape[0], 2):
        raise ValueError(f"bidirectional_ranges must be [{query.shape[0]}, 2]; got {list(ranges.shape)}")
    if ranges.dtype not in (torch.int32, torch.int64) or ranges.device != query.device:
        raise ValueError(f"bidirectional_ranges must be int32 on {query.device}; got {ranges.dtype} on "
                         f"{ranges.device}")
