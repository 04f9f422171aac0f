"""The engine's CPU rotary embedding: the native kernels (`rotary.cpp`) where they serve, else the reference."""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import native
from pagedserve.kernels.native.fp8 import cache_dtype_code
from pagedserve.kernels.rope import reference

_rotary_kernel = native.Function(
    "pagedserve_rotary", [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_int]
)
_rotary_and_cache_kernel = native.Function(
    "pagedserve_rotary_and_cache",
    [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 7 + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float],
)
# The fused write quantizes into an fp8 cache itself (kernels.kv8's rule, torch's rounding).
SUPPORTS_FP8_KV = True
_table: tuple[tuple, torch.Tensor] | None = None


def _rotary_rows(*tensors: torch.Tensor) -> bool:
    """[T, H, D] tensors whose heads are dense rows of an even head size, as the native kernels read."""
    head_dim = tensors[0].shape[-1]
    return head_dim % 2 == 0 and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in tensors)


def _float_table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """The cos/sin table as contiguous fp32, converted once per table (the model keeps one for its life)."""
    global _table
    if cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous():
        return cos_sin_cache
    key = (cos_sin_cache.data_ptr(), cos_sin_cache.dtype, tuple(cos_sin_cache.shape))
    if _table is None or _table[0] != key:
        _table = (key, cos_sin_cache.float().contiguous())
    return _table[1]


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.rope.rotary_embedding into new contiguous tensors; query/key may be strided views (a QKV split)."""
    if not _rotary_rows(query, key) or not native.serves(query, key):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    pos = positions.to(torch.int64).contiguous()
    _rotary_kernel(
        q_out.data_ptr(), k_out.data_ptr(), query.data_ptr(), key.data_ptr(), pos.data_ptr(),
        _float_table(cos_sin_cache).data_ptr(), num_tokens, num_q_heads, key.shape[1], head_dim, query.stride(0),
        key.stride(0), native.dtype_code(query),
    )
    return q_out, k_out


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> torch.Tensor | None:
    """The rotated query (new tensor), the rotated key and the value written into their slots, in one native
    pass (quantized with k_scale / v_scale into an fp8 cache); None where the native kernel cannot serve these
    tensors (the caller then runs the two ops)."""
    caches_dense = key_cache.is_contiguous() and value_cache.is_contiguous()
    cache_code = cache_dtype_code(key_cache, query)
    if (not _rotary_rows(query, key, value) or not caches_dense or cache_code is None
            or value_cache.dtype != key_cache.dtype or not native.serves(query, key, value)):
        return None
    num_tokens, num_q_heads, head_dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype)
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    _rotary_and_cache_kernel(
        q_out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), pos.data_ptr(),
        _float_table(cos_sin_cache).data_ptr(), slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        num_tokens, num_q_heads, key.shape[1], head_dim, query.stride(0), key.stride(0), value.stride(0),
        native.dtype_code(query), cache_code, k_scale, v_scale,
    )
    return q_out
