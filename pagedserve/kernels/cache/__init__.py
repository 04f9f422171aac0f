"""Writes into the paged KV cache: new tokens' K/V into their slots, whole blocks for copy-on-write.

KV cache per layer: `key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block_id * block_size + offset`. An fp8 cache stores K / k_scale and V / v_scale (kernels.kv8).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels import kv8
from pagedserve.kernels.cache import reference
from pagedserve.kernels.dispatch import Implementations


def _load_triton() -> ModuleType:
    from pagedserve.kernels.cache import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, load_triton=_load_triton)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 skipped
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its cache slot; slot -1 (padding) is skipped. An fp8 cache is written
    quantized with k_scale / v_scale; the scales are ignored otherwise."""
    module, fp8 = kv8.route(_IMPLEMENTATIONS.select(key), reference, key_cache, k_scale, v_scale)
    module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **fp8)


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: list[torch.Tensor],
    block_mapping: list[tuple[int, int]],  # (src, dst) block ids
) -> None:
    """Copy whole blocks src -> dst in every layer's K and V cache (copy-on-write); fp8 bytes unchanged."""
    if not block_mapping:
        return
    _IMPLEMENTATIONS.select(key_caches[0]).copy_blocks(key_caches, value_caches, block_mapping)
