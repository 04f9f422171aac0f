"""Rejection sampling of draft tokens (speculative decoding): draft i of a sequence is accepted with
probability min(1, p_i(d) / q_i(d)); the first rejected position draws from normalised max(0, p_i - q_i)
instead, and a sequence whose drafts all pass draws its next token from the target's last row. The
output follows the target distribution exactly whatever q is, provided each draft was drawn from q."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.rejection import reference


def _load_triton() -> ModuleType:
    from pagedserve.kernels.rejection import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, None, _load_triton)


def rejection_sample(
    draft_ids: torch.Tensor,  # [B, K] int64; row b's drafts are its first num_drafts[b]
    num_drafts: torch.Tensor,  # [B] int64 in [0, K]
    draft_probs: torch.Tensor | None,  # [B, K, V] fp32, the distribution each draft came from; None: a point mass
    target_probs: torch.Tensor,  # [B, K + 1, V] fp32, each position's target distribution (rows sum to 1)
    uniforms: torch.Tensor,  # [B, K + 1] float64 in [0, 1), one per position
) -> torch.Tensor:  # [B, K + 1] int64: the accepted drafts, then the drawn token, then -1
    """Verify every sequence's drafts; each position uses its uniform for the acceptance test and, once
    rejected, rescaled to [0, 1), for the inverse-CDF draw (the bonus position: as is)."""
    return _IMPLEMENTATIONS.select(target_probs).rejection_sample(
        draft_ids, num_drafts, draft_probs, target_probs, uniforms)
