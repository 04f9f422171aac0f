"""The sampler's vocabulary-wide ops: widening logits to fp32, the inverse-CDF draw, log-sum-exp, greedy argmax.

No Triton kernels: on the GPU these run as torch ops (the reference).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.sampling import cpu, reference

_IMPLEMENTATIONS = Implementations(reference, cpu)


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 (the logits the sampler reads); exact."""
    return _IMPLEMENTATIONS.select(x).to_float32(x)


def sample_from_logits(
    logits: torch.Tensor,  # [R, V] fp32, -inf where masked
    inv_temps: torch.Tensor,  # [R] 1 / temperature
    min_ps: torch.Tensor,  # [R] 0 = off
    uniforms: torch.Tensor,  # [R] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # -> tokens [R] int64, normaliser [R] fp32
    """One inverse-CDF draw per row from exp((x - max) / T) with min_p applied; also max / T + log(total mass)."""
    return _IMPLEMENTATIONS.select(logits).sample_from_logits(logits, inv_temps, min_ps, uniforms)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R]
    """Log-sum-exp of each row."""
    return _IMPLEMENTATIONS.select(logits).logsumexp(logits)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """Each row's first largest value's index (a NaN, first, where the row holds one), as torch.argmax."""
    return _IMPLEMENTATIONS.select(logits).argmax(logits)
