"""The 8-bit KV cache's numbers: which dtypes, the write and read rules, and which module serves an fp8 cache.

A cache tensor allocated in an fp8 dtype holds `(x.float() / scale)` clamped to the format's finite range and
rounded to nearest even (torch's cast); it reads back as `stored.float() * scale`. Scales are per tensor and per
layer (`k_scale`, `v_scale`), fixed at load. An implementation module reads and writes fp8 caches only when it says
`SUPPORTS_FP8_KV = True`; otherwise an fp8 call runs the op's reference (correct, slow).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# kv_cache_dtype values (vLLM's) -> the cache tensors' dtype; "auto" is the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(tensor: torch.Tensor) -> bool:
    """Whether this tensor (a cache) holds 8-bit floats."""
    return tensor.dtype in FP8_DTYPES


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensors' dtype for a kv_cache_dtype value (one of KV_CACHE_DTYPES)."""
    chosen = KV_CACHE_DTYPES[kv_cache_dtype]
    return model_dtype if chosen is None else chosen


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The stored form of x in an fp8 cache: x / scale in fp32, saturated to the format's finite range."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache holds, in fp32: stored * scale."""
    return stored.float() * scale


def route(module: ModuleType, reference: ModuleType, cache: torch.Tensor, k_scale: float,
          v_scale: float) -> tuple[ModuleType, dict[str, Any]]:
    """The module that serves a call on this cache and the keywords it takes: the scales only for an fp8 cache,
    and an fp8 cache only by a module that declares SUPPORTS_FP8_KV (else the reference)."""
    if not is_fp8(cache):
        return module, {}
    if not getattr(module, "SUPPORTS_FP8_KV", False):
        module = reference
    return module, {"k_scale": k_scale, "v_scale": v_scale}
