"""SiLU-and-mul and GELU(tanh)-and-mul: the SwiGLU and GeGLU activations over a fused gate/up projection."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels.activation import cpu, reference
from pagedserve.kernels.dispatch import Implementations


def _load_triton() -> ModuleType:
    from pagedserve.kernels.activation import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SiLU(gate) * up over the two halves [gate | up] of the last dimension."""
    return _IMPLEMENTATIONS.select(x).silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """GELU(gate, tanh approximation) * up over the two halves [gate | up] of the last dimension (Gemma's GeGLU)."""
    return _IMPLEMENTATIONS.select(x).gelu_tanh_and_mul(x)
