"""The engine's CPU activations: SiLU-and-mul's native fused kernel (`silu_and_mul.cpp`) where it serves, else the
reference; GELU(tanh)-and-mul through torch's own vectorised GELU."""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native
from pagedserve.kernels.activation import reference

_silu_and_mul_kernel = native.Function(
    "pagedserve_silu_and_mul", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul in one native pass over each row."""
    if not native.serves(x):
        return reference.silu_and_mul(x)
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _silu_and_mul_kernel(out.data_ptr(), x.data_ptr(), out.numel() // max(inter, 1), inter, native.dtype_code(x))
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.gelu_tanh_and_mul: the reference (ATen's GELU kernel is already vectorised)."""
    return reference.gelu_tanh_and_mul(x)
