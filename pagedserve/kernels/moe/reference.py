"""The torch reference of top-k routing and the MoE forward, step for step as transformers' Mixtral / Qwen-MoE
blocks compute them: the oracle the CPU and Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.moe.topk_routing: fp32 softmax over the experts, the top k, optionally rescaled to sum to one."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe.fused_moe one expert at a time over the tokens routed to it, added up in x's dtype."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out
