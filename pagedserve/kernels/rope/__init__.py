"""Neox-style rotary embedding, alone or fused with the KV cache write, and its cos/sin table."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels import kv8
from pagedserve.kernels.cache import reshape_and_cache
from pagedserve.kernels.dispatch import Backend, Implementations, backend_for
from pagedserve.kernels.rope import cpu, reference
from pagedserve.kernels.rope.cos_sin import compute_cos_sin_cache

__all__ = ["compute_cos_sin_cache", "rotary_embedding", "rotary_embedding_and_cache"]


def _load_triton() -> ModuleType:
    from pagedserve.kernels.rope import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] rows [cos(D/2) | sin(D/2)]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key at their positions as transformers' Llama does; returns new tensors."""
    return _IMPLEMENTATIONS.select(query).rotary_embedding(positions, query, key, cos_sin_cache)


def rotary_embedding_and_cache(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 skipped
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """rotary_embedding, then reshape_and_cache of the rotated key and the value; returns the rotated query.

    One native pass on the CPU where it serves the tensors (the rotated key goes straight into its slot); an fp8
    cache only where the CPU module declares SUPPORTS_FP8_KV (k_scale / v_scale as in reshape_and_cache).
    """
    if backend_for(query) is Backend.CPU:
        module, fp8 = kv8.route(cpu, reference, key_cache, k_scale, v_scale)
        if module is cpu:
            fused = cpu.rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, key_cache,
                                                   value_cache, slot_mapping, **fp8)
            if fused is not None:
                return fused
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return query
