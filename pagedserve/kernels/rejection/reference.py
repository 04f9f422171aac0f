"""The torch reference of rejection sampling: the oracle, and the CPU path."""

from __future__ import annotations

import torch


def rejection_sample(draft_ids: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """kernels.rejection.rejection_sample, vectorised over the batch."""
    batch, k = draft_ids.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    positions = torch.arange(k, device=device)
    p = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2).double()  # [B, K]
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2).double()
    rejected = (uniforms[:, :k] * q >= p) & (positions[None] < num_drafts[:, None])
    # The first rejected position, else num_drafts (the bonus position).
    first = torch.where(rejected, positions[None], k).amin(dim=1).minimum(num_drafts) if k else num_drafts.clone()
    is_bonus = first == num_drafts
    residual = target_probs[rows, first].double()  # [B, V]
    if k:
        at = first.clamp(max=k - 1)
        d = draft_ids[rows, at]
        if draft_probs is None:
            drop = torch.zeros_like(residual).scatter_(1, d[:, None], 1.0)
        else:
            drop = draft_probs[rows, at].double()
        residual = torch.where(is_bonus[:, None], residual, (residual - drop).clamp_(min=0.0))
        p_at, q_at = p[rows, at], q[rows, at]
        ratio = torch.where(q_at > 0, p_at / q_at, 0.0).clamp(max=1.0)  # a rejected q = 0 draft had p = 0
        u = uniforms[rows, first]
        u = torch.where(is_bonus, u, ((u - ratio) / (1.0 - ratio)).clamp(0.0, 1.0))
    else:
        u = uniforms[:, 0]
    # Rounding can leave nothing of p - q where p <= q almost everywhere: then draw from p.
    empty = residual.sum(dim=1) <= 0
    residual = torch.where(empty[:, None], target_probs[rows, first].double(), residual)
    token = _inverse_cdf(residual, u)
    out = torch.where(positions[None] < first[:, None], draft_ids, -1)
    return torch.cat([out, torch.full((batch, 1), -1, dtype=out.dtype, device=device)], dim=1).scatter_(
        1, first[:, None], token[:, None])


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative weight exceeds u * total (float64), one per row."""
    cdf = weights.cumsum(dim=1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
