"""Mixture of experts: top-k routing over the router's logits, and the fused expert forward over stacked
weights, w13 [E, 2I, H] ([gate | up] rows) and w2 [E, H, I], each token's k experts weighted and summed."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.moe import cpu, reference


def _load_triton() -> ModuleType:
    from pagedserve.kernels.moe import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def topk_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,  # rescale the k weights to sum to one (Mixtral; Qwen-MoE's norm_topk_prob)
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] fp32 weights, [T, k] int64 expert ids): softmax in fp32, then the k largest, as transformers routes.

    Torch ops on every backend: a [T, E] softmax and top-k are small beside the experts' GEMMs.
    """
    assert router_logits.dim() == 2, "router_logits must be [T, E]"
    assert 1 <= top_k <= router_logits.shape[1], f"top_k {top_k} must be in 1..{router_logits.shape[1]} experts"
    return reference.topk_routing(router_logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] each expert's gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] routing weights (fp32, or x's dtype as Qwen-MoE rounds them)
    topk_ids: torch.Tensor,  # [T, k] int expert ids
) -> torch.Tensor:
    """[T, H] in x's dtype: sum over j of topk_weights[t, j] * w2[e] @ (SiLU(gate_e x_t) * up_e x_t), e = ids[t, j]."""
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]"
    num_experts, two_inter, hidden = w13.shape
    assert hidden == x.shape[1] and two_inter % 2 == 0, f"w13 is {list(w13.shape)} but x has H = {x.shape[1]}"
    assert w2.shape == (num_experts, hidden, two_inter // 2), f"w2 is {list(w2.shape)}, w13 {list(w13.shape)}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], "topk_ids must be [T, k] with x's rows"
    assert topk_weights.shape == topk_ids.shape, "topk_weights must be topk_ids' shape"
    assert not topk_ids.dtype.is_floating_point, "topk_ids must be an integer tensor"
    return _IMPLEMENTATIONS.select(x).fused_moe(x, w13, w2, topk_weights, topk_ids)


__all__ = ["fused_moe", "topk_routing"]
