"""The torch reference of the KV cache writes: the oracle, and what runs on the CPU."""

from __future__ import annotations

import torch

from pagedserve.kernels import kv8

SUPPORTS_FP8_KV = True  # the oracle of the fp8 write: kv8.quantize


def _write(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """x into its slots as the cache holds it: quantized for an fp8 cache (written as bytes: torch has no
    index_copy_ for fp8), else cast."""
    if kv8.is_fp8(flat_cache):
        stored = kv8.quantize(x, flat_cache.dtype, scale)
        flat_cache.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, x.to(flat_cache.dtype))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
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
    _write(flat_k, slots, k, k_scale)
    _write(flat_v, slots, v, v_scale)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: list[tuple[int, int]]) -> None:
    """kernels.cache.copy_blocks with one gather and one scatter per cache tensor."""
    if not block_mapping:
        return
    device = key_caches[0].device
    src = torch.tensor([s for s, _ in block_mapping], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in block_mapping], dtype=torch.long, device=device)
    for cache in (*key_caches, *value_caches):
        cache = cache.view(torch.uint8) if kv8.is_fp8(cache) else cache  # bytes unchanged; no fp8 index_copy_
        cache.index_copy_(0, dst, cache.index_select(0, src))
