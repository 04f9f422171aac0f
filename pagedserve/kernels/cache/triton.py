"""Triton kernels that write the paged KV cache: reshape_and_cache and copy_blocks (copy-on-write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv * D] rows of the new keys
    value_ptr,  # [T, Hkv * D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv * D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv * D]
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_vt,
    stride_kcb, stride_kcs,
    stride_vcb, stride_vcs,
    ROW: tl.constexpr,  # Hkv * D
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Grid (T,): copy one token's K and V rows into its slot; slot -1 means padding and is skipped."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(key_ptr + token * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs, mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + in_block * stride_kcs + offs,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + in_block * stride_vcs + offs,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [num_blocks, block_numel] one layer's K or V cache
    mapping_ptr,  # [P, 2] int64 (src, dst) block ids
    block_numel,
    BLOCK: tl.constexpr,
):
    """Grid (P, cdiv(block_numel, BLOCK)): copy one slice of block src into block dst."""
    pair = tl.program_id(0).to(tl.int64)
    src = tl.load(mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(mapping_ptr + pair * 2 + 1).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    data = tl.load(cache_ptr + src * block_numel + offs, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offs, data, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """kernels.cache.reshape_and_cache: one program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for t in (key, value):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "key/value rows must be [Hkv, D] contiguous"
    for c in (key_cache, value_cache):
        assert c.dim() == 4 and c.shape[2:] == (num_kv_heads, head_dim), "cache must be [NB, BS, Hkv, D]"
        assert c.stride(3) == 1 and c.stride(2) == head_dim, "cache slots must be [Hkv, D] contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() == num_tokens, "slot_mapping: [T] int64"
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        key.stride(0), value.stride(0),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        ROW=row, ROW_PAD=triton.next_power_of_2(row), BLOCK_SIZE=key_cache.shape[1], num_warps=4,
    )


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer's caches; one launch per cache tensor (CoW is rare)."""
    if not block_mapping:
        return
    mapping = torch.tensor(block_mapping, dtype=torch.int64, device=key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        assert cache.is_contiguous(), "copy_blocks needs contiguous caches"
        block_numel = cache[0].numel()
        block = min(4096, triton.next_power_of_2(block_numel))
        _copy_blocks_kernel[(len(block_mapping), triton.cdiv(block_numel, block))](
            cache, mapping, block_numel, BLOCK=block, num_warps=4,
        )
