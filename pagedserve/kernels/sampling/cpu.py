"""The engine's CPU sampling ops: the native kernels (`sampling.cpp`) on fp32 rows, else the reference."""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native
from pagedserve.kernels.sampling import reference

_sample_kernel = native.Function(
    "pagedserve_sample", [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2,
    value_errors={2: "a logits row has no finite value to sample from"},
)
_logsumexp_kernel = native.Function("pagedserve_logsumexp", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
_argmax_kernel = native.Function("pagedserve_argmax", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
_bf16_to_float_kernel = native.Function("pagedserve_bf16_to_float", [ctypes.c_void_p] * 2 + [ctypes.c_int64])


def _native_rows(logits: torch.Tensor) -> bool:
    return logits.dtype == torch.float32 and native.load() is not None


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.to_float32; bf16 widens in one vectorised native pass."""
    if x.dtype != torch.bfloat16 or native.load() is None:
        return reference.to_float32(x)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _bf16_to_float_kernel(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def sample_from_logits(logits: torch.Tensor, inv_temps: torch.Tensor, min_ps: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.sampling.sample_from_logits in three native passes over each fp32 row."""
    if not _native_rows(logits):
        return reference.sample_from_logits(logits, inv_temps, min_ps, uniforms)
    rows, vocab = logits.shape
    logits = logits.contiguous()
    inv_temps = inv_temps.to(torch.float32).contiguous()
    min_ps = min_ps.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    _sample_kernel(logits.data_ptr(), inv_temps.data_ptr(), min_ps.data_ptr(), uniforms.data_ptr(),
                   tokens.data_ptr(), lse.data_ptr(), rows, vocab)
    return tokens, lse


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.logsumexp in one native pass over each fp32 row."""
    if not _native_rows(logits):
        return reference.logsumexp(logits)
    logits = logits.contiguous()
    lse = torch.empty(logits.shape[0], dtype=torch.float32)
    _logsumexp_kernel(logits.data_ptr(), lse.data_ptr(), *logits.shape)
    return lse


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.argmax in one vectorised native pass over each fp32 row (max, NaN check) and a search for its first index."""
    if not _native_rows(logits) or logits.dim() != 2 or logits.shape[1] == 0:
        return reference.argmax(logits)
    logits = logits.contiguous()
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    _argmax_kernel(logits.data_ptr(), tokens.data_ptr(), *logits.shape)
    return tokens
