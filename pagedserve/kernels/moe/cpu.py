"""The MoE forward on the CPU: the (token, expert) pairs sorted by expert once, then per expert that has tokens
one GEMM over its contiguous rows for w13 and one for w2; SiLU-and-mul, the routing weights and the sum back
into tokens run once over all rows. No Python work per token."""

from __future__ import annotations

import torch

from pagedserve.kernels.activation import silu_and_mul


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe.fused_moe as grouped GEMMs over expert-sorted rows."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # stable: each token's experts stay in ascending order
    token = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    gate_up = _grouped_linear(x[token], w13, counts)  # [T*k, 2I]
    down = _grouped_linear(silu_and_mul(gate_up), w2, counts)  # [T*k, H]
    weighted = (down * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, weighted)


def _grouped_linear(rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows[group e] @ weights[e].T for consecutive groups of counts[e] rows: [R, K] x [E, N, K] -> [R, N]."""
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            torch.matmul(rows[start:start + count], weights[expert].T, out=out[start:start + count])
            start += count
    return out
