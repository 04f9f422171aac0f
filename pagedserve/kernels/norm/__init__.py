"""RMSNorm, with the residual add fused in."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.norm import cpu, reference


def _load_triton() -> ModuleType:
    from pagedserve.kernels.norm import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with fp32 statistics; with residual returns (norm(x + residual), x + residual)."""
    return _IMPLEMENTATIONS.select(x).rms_norm(x, weight, eps, residual)
