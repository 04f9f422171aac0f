"""The engine's CPU element-wise ops: the native fused kernels where they serve the tensors, else the reference."""

from __future__ import annotations

import torch
from pagedserve.kernels import cpu_native, reference


def _native(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a CPU fp32/bf16 tensor of one dtype and the native library loads."""
    first = tensors[0]
    return (
        cpu_native.dtype_code(first) is not None
        and all(t.dtype == first.dtype and t.device.type == "cpu" for t in tensors)
        and cpu_native.load() is not None
    )


def _rotary_rows(*tensors: torch.Tensor) -> bool:
    """[T, H, D] tensors whose heads are dense rows of an even head size, as the native rotary kernels read."""
    head_dim = tensors[0].shape[-1]
    return head_dim % 2 == 0 and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in tensors)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with residual returns (norm(x + residual), x + residual)."""
    extra = () if residual is None else (residual,)
    if x.dim() != 2 or not _native(x, weight, *extra):
        return reference.rms_norm(x, weight, eps, residual)
    return cpu_native.rms_norm(x.contiguous(), weight.contiguous(), eps,
                               None if residual is None else residual.contiguous())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SiLU(gate) * up over the two halves of the last dimension."""
    if not _native(x):
        return reference.silu_and_mul(x)
    return cpu_native.silu_and_mul(x.contiguous())


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding; returns new (query, key) tensors."""
    if not _rotary_rows(query, key) or not _native(query, key):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    return cpu_native.rotary_embedding(positions, query, key, cos_sin_cache)


def rotary_embedding_and_cache(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
) -> torch.Tensor | None:
    """The rotated query, the rotated key and the value written into their slots, in one native pass;
    None where the native kernel cannot serve these tensors (ops then runs the two ops in turn)."""
    caches_dense = key_cache.is_contiguous() and value_cache.is_contiguous()
    if not _rotary_rows(query, key, value) or not caches_dense or not _native(query, key, value, key_cache,
                                                                               value_cache):
        return None
    return cpu_native.rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, key_cache,
                                                 value_cache, slot_mapping)
