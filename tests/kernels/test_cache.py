"""reshape_and_cache and copy_blocks: Triton under the interpreter against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cache import reference
from pagedserve.kernels.cache import triton as cache_triton

IMPLS = [pytest.param(reference, id="torch"), pytest.param(cache_triton, id="triton")]


def _qkv_split(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """K and V as the model makes them: strided views into one fused projection output."""
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim).to(dtype)
    _, k, v = fused.split(num_kv_heads * head_dim, dim=-1)
    return k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_each_token_to_its_slot_and_skips_padding(impl, dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 2, 80
    key, value = _qkv_split(5, num_kv_heads, head_dim, dtype)
    assert not key.is_contiguous()
    slots = torch.tensor([17, -1, 95, 0, 40], dtype=torch.int64)
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    impl.reshape_and_cache(key, value, key_cache, value_cache, slots)

    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_reshape_and_cache_reaches_slots_past_int32_element_offsets():
    # The pool is reserved virtual memory only; see test_paged_attention's int64 case.
    block_size, head_dim = 16, 16
    num_blocks = 2**31 // (block_size * head_dim) + 8
    key_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16)
    value_cache = torch.empty_like(key_cache)
    key, value = torch.randn(2, 1, head_dim).half(), torch.randn(2, 1, head_dim).half()
    slots = torch.tensor([(num_blocks - 1) * block_size + 5, 3], dtype=torch.int64)
    cache_triton.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[num_blocks - 1, 5], key[0]) and torch.equal(value_cache[0, 3], value[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_blocks_copies_every_layer_and_leaves_others_alone(impl):
    gen = torch.Generator().manual_seed(0)
    key_caches = [torch.randn(8, 16, 2, 64, generator=gen) for _ in range(2)]
    value_caches = [torch.randn(8, 16, 2, 64, generator=gen) for _ in range(2)]
    before_k = [c.clone() for c in key_caches]
    before_v = [c.clone() for c in value_caches]
    impl.copy_blocks(key_caches, value_caches, [(1, 5), (6, 2)])
    for after, before in zip([*key_caches, *value_caches], [*before_k, *before_v], strict=True):
        assert torch.equal(after[5], before[1]) and torch.equal(after[2], before[6])
        for block in (0, 1, 3, 4, 6, 7):
            assert torch.equal(after[block], before[block])
