"""The engine's CPU RMSNorm: the native fused kernel (`rms_norm.cpp`) where it serves the tensors, else the reference."""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native
from pagedserve.kernels.norm import reference

_rms_norm_kernel = native.Function(
    "pagedserve_rms_norm", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kernels.norm.rms_norm in one native pass over each row."""
    extra = () if residual is None else (residual,)
    if x.dim() != 2 or not native.serves(x, weight, *extra):
        return reference.rms_norm(x, weight, eps, residual)
    x, weight = x.contiguous(), weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    _rms_norm_kernel(
        out.data_ptr(), summed.data_ptr() if summed is not None else None, x.data_ptr(),
        residual.data_ptr() if residual is not None else None, weight.data_ptr(), x.shape[0], x.shape[1],
        eps, native.dtype_code(x),
    )
    return out if summed is None else (out, summed)
