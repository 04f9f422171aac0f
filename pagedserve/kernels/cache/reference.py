"""The torch reference of the KV cache writes: the oracle, and what runs on the CPU."""

from __future__ import annotations

import torch


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """kernels.cache.reshape_and_cache with one index_copy_ per cache."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    flat_k = key_cache.view(num_slots, *key_cache.shape[2:])
    flat_v = value_cache.view(num_slots, *value_cache.shape[2:])
    keep = slot_mapping >= 0
    # Padding slots (-1) are rare; avoid the boolean-index host sync when there are none.
    if bool(keep.all()):
        slots, k, v = slot_mapping, key, value
    else:
        slots, k, v = slot_mapping[keep], key[keep], value[keep]
    flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, v.to(flat_v.dtype))


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: list[tuple[int, int]]) -> None:
    """kernels.cache.copy_blocks with one gather and one scatter per cache tensor."""
    if not block_mapping:
        return
    device = key_caches[0].device
    src = torch.tensor([s for s, _ in block_mapping], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in block_mapping], dtype=torch.long, device=device)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))
