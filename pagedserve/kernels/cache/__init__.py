"""Writes into the paged KV cache: new tokens' K/V into their slots, whole blocks for copy-on-write.

KV cache per layer: `key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block_id * block_size + offset`.
"""

from __future__ import annotations

from types import ModuleType

import torch

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
) -> None:
    """Write each token's K/V into its cache slot; slot -1 (padding) is skipped."""
    _IMPLEMENTATIONS.select(key).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: list[torch.Tensor],
    block_mapping: list[tuple[int, int]],  # (src, dst) block ids
) -> None:
    """Copy whole blocks src -> dst in every layer's K and V cache (copy-on-write)."""
    if not block_mapping:
        return
    _IMPLEMENTATIONS.select(key_caches[0]).copy_blocks(key_caches, value_caches, block_mapping)
