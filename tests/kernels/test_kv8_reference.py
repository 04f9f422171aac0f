"""The 8-bit KV cache's reference: quantize/dequantize rules, the write and attention references on an fp8 cache,
and the entries' routing (scales only for fp8 caches; a module without SUPPORTS_FP8_KV never sees one)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import attention, cache, kv8, rope
from pagedserve.kernels.attention import reference as attention_reference
from pagedserve.kernels.cache import reference as cache_reference
from pagedserve.kernels.rope import reference as rope_reference
from tests.support.paged_attention import BF16_TOL, FP32_TOL, MIXED, make_batch

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
# Relative rounding error of a normal value: half an ulp of 3 (e4m3) or 2 (e5m2) mantissa bits.
REL_ERR = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37, 4.0])
def test_round_trip_is_exact_on_representable_values_and_within_half_an_ulp_elsewhere(dtype, scale):
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = every[torch.isfinite(every.float())]
    exact = finite.float() * scale
    assert torch.equal(kv8.dequantize(kv8.quantize(exact, dtype, scale), scale), exact)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * scale
    normal = x.abs() / scale >= torch.finfo(dtype).smallest_normal
    back = kv8.dequantize(kv8.quantize(x, dtype, scale), scale)
    assert ((back - x).abs()[normal] <= REL_ERR[dtype] * x.abs()[normal]).all()


@pytest.mark.parametrize("dtype", FP8)
def test_values_beyond_the_range_saturate_instead_of_becoming_inf_or_nan(dtype):
    limit = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, 3 * limit, float("inf"), float("-inf")])
    stored = kv8.quantize(x, dtype, 2.0).float()
    assert torch.equal(stored, torch.tensor([limit, -limit, limit, limit, -limit]))


def test_the_contract_bit_tricks_match_torchs_fp8_conversion_for_every_byte():
    # e4m3 -> fp32 bits sign<<31 | (b & 0x7f) << 20, times 2^120; e5m2 -> fp16 bits b << 8 (the native kernels').
    b = torch.arange(256, dtype=torch.int32)
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    e4m3 = bits.view(torch.float32) * 2.0**120
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(want)  # 0x7f and 0xff are e4m3's NaNs
    assert torch.equal(e4m3[finite], want[finite])
    e5m2 = (b << 8).to(torch.int16).view(torch.float16).float()
    want = b.to(torch.uint8).view(torch.float8_e5m2).float()
    assert torch.equal(e5m2.nan_to_num(), want.nan_to_num())


def _caches(dtype, num_blocks=6, block_size=4, heads=2, head_dim=8):
    shape = (num_blocks, block_size, heads, head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("dtype", FP8)
def test_reference_write_stores_the_quantized_bytes_in_their_slots_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 2, 8, generator=gen) * 3, torch.randn(5, 2, 8, generator=gen)
    key_cache, value_cache = _caches(dtype)
    slots = torch.tensor([3, 17, -1, 0, 22])
    kernels.reshape_and_cache(key.bfloat16(), value.bfloat16(), key_cache, value_cache, slots, k_scale=0.5,
                              v_scale=2.0)
    flat_k, flat_v = key_cache.view(-1, 2, 8), value_cache.view(-1, 2, 8)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want_k = kv8.quantize(key[row].bfloat16(), dtype, 0.5)
        assert torch.equal(flat_k[slot].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(flat_v[slot].view(torch.uint8), kv8.quantize(value[row].bfloat16(), dtype, 2.0)
                           .view(torch.uint8))
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].view(torch.uint8).any()


@pytest.mark.parametrize("dtype", FP8)
def test_copy_blocks_copies_fp8_bytes_unchanged(dtype):
    key_cache, value_cache = (torch.randn(6, 4, 2, 8).to(dtype) for _ in range(2))
    before_k, before_v = key_cache.clone(), value_cache.clone()
    kernels.copy_blocks([key_cache], [value_cache], [(1, 4), (0, 5)])
    assert torch.equal(key_cache[4].view(torch.uint8), before_k[1].view(torch.uint8))
    assert torch.equal(value_cache[5].view(torch.uint8), before_v[0].view(torch.uint8))
    assert torch.equal(key_cache[:4].view(torch.uint8), before_k[:4].view(torch.uint8))


def _fp8_batch(dtype, query_dtype, k_scale, v_scale):
    batch = make_batch(MIXED, 2, 4, 64, 16, dtype=query_dtype, seed=3)
    stored_k = kv8.quantize(batch.key_cache * 1.7, dtype, k_scale)
    stored_v = kv8.quantize(batch.value_cache * 0.3, dtype, v_scale)
    return batch, stored_k, stored_v


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (20, None), (None, 30.0)])
def test_reference_attention_on_fp8_equals_attention_on_the_dequantized_cache(dtype, query_dtype, window,
                                                                              soft_cap):
    batch, stored_k, stored_v = _fp8_batch(dtype, query_dtype, 0.25, 0.05)
    args = list(batch.args())
    mods = {"sliding_window": window, "logits_soft_cap": soft_cap}
    args[1], args[2] = kv8.dequantize(stored_k, 0.25), kv8.dequantize(stored_v, 0.05)
    want = attention_reference.paged_attention(*args, **mods)
    args[1], args[2] = stored_k, stored_v
    got = attention_reference.paged_attention(*args, **mods, k_scale=0.25, v_scale=0.05)
    assert got.dtype == query_dtype
    assert torch.equal(got, want)
    # The entry, whichever module serves this fp8 cache, agrees to the query dtype's rounding.
    served = kernels.paged_attention(*args, **mods, k_scale=0.25, v_scale=0.05)
    tolerance = FP32_TOL if query_dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(served.float(), want.float(), **tolerance)


def test_single_fresh_prompt_on_fp8_equals_the_dequantized_cache():
    batch = make_batch([(37, 37)], 2, 4, 64, 16, seed=4)
    stored_k = kv8.quantize(batch.key_cache, torch.float8_e4m3fn, 0.5)
    stored_v = kv8.quantize(batch.value_cache, torch.float8_e4m3fn, 0.5)
    args = list(batch.args())
    args[1], args[2] = kv8.dequantize(stored_k, 0.5), kv8.dequantize(stored_v, 0.5)
    want = attention_reference.paged_attention(*args)
    args[1], args[2] = stored_k, stored_v
    assert torch.equal(attention_reference.paged_attention(*args, k_scale=0.5, v_scale=0.5), want)


class _Recorder:
    """An implementation module that records the keywords each call got."""

    def __init__(self, supports_fp8: bool | None):
        self.calls: list[dict] = []
        if supports_fp8 is not None:
            self.SUPPORTS_FP8_KV = supports_fp8

    def paged_attention(self, *args, **kwargs):
        self.calls.append(kwargs)
        return args[0]

    def reshape_and_cache(self, *args, **kwargs):
        self.calls.append(kwargs)


@pytest.mark.parametrize("supports_fp8", [None, False])
def test_fp8_calls_go_to_the_reference_when_the_module_lacks_the_flag(monkeypatch, supports_fp8):
    fake = _Recorder(supports_fp8)
    monkeypatch.setattr(attention._IMPLEMENTATIONS, "select", lambda tensor: fake)
    monkeypatch.setattr(cache._IMPLEMENTATIONS, "select", lambda tensor: fake)
    batch, stored_k, stored_v = _fp8_batch(torch.float8_e4m3fn, torch.float32, 1.0, 1.0)
    args = list(batch.args())
    args[1], args[2] = stored_k, stored_v
    out = kernels.paged_attention(*args, k_scale=1.0, v_scale=1.0)
    assert torch.equal(out, attention_reference.paged_attention(*args))
    key_cache, value_cache = _caches(torch.float8_e4m3fn)
    kernels.reshape_and_cache(torch.ones(1, 2, 8), torch.ones(1, 2, 8), key_cache, value_cache,
                              torch.tensor([5]), k_scale=0.5)
    assert float(key_cache.view(-1, 2, 8)[5].float().max()) == 2.0
    assert fake.calls == []


def test_a_module_with_the_flag_gets_the_scales_only_for_fp8_caches(monkeypatch):
    fake = _Recorder(True)
    monkeypatch.setattr(attention._IMPLEMENTATIONS, "select", lambda tensor: fake)
    monkeypatch.setattr(cache._IMPLEMENTATIONS, "select", lambda tensor: fake)
    batch = make_batch(MIXED, 2, 4, 64, 16, seed=5)
    kernels.paged_attention(*batch.args(), k_scale=0.5, v_scale=2.0)
    args = list(batch.args())
    args[1], args[2] = batch.key_cache.to(torch.float8_e5m2), batch.value_cache.to(torch.float8_e5m2)
    kernels.paged_attention(*args, sliding_window=8, k_scale=0.5, v_scale=2.0)
    key_cache, value_cache = _caches(torch.float8_e4m3fn)
    kernels.reshape_and_cache(torch.ones(1, 2, 8), torch.ones(1, 2, 8), key_cache, value_cache,
                              torch.tensor([5]), k_scale=0.25, v_scale=4.0)
    kernels.reshape_and_cache(torch.ones(1, 2, 8), torch.ones(1, 2, 8), *_caches(torch.float32),
                              torch.tensor([5]), k_scale=0.25)
    assert fake.calls == [
        {},
        {"sliding_window": 8, "logits_soft_cap": None, "k_scale": 0.5, "v_scale": 2.0},
        {"k_scale": 0.25, "v_scale": 4.0},
        {},
    ]


@pytest.mark.parametrize("dtype", FP8)
def test_rotary_and_cache_on_fp8_writes_the_rotated_key_quantized(dtype):
    gen = torch.Generator().manual_seed(6)
    query, key, value = (torch.randn(5, h, 8, generator=gen) for h in (4, 2, 2))
    positions = torch.tensor([0, 3, 9, 10, 2])
    table = kernels.compute_cos_sin_cache(8, 64, 10000.0, None, torch.float32)
    key_cache, value_cache = _caches(dtype)
    slots = torch.tensor([1, 6, 11, -1, 20])
    rotated_q = rope.rotary_embedding_and_cache(positions, query, key, value, table, key_cache, value_cache,
                                                slots, k_scale=0.5, v_scale=0.25)
    want_q, want_k = rope_reference.rotary_embedding(positions, query, key, table)
    want_key_cache, want_value_cache = _caches(dtype)
    cache_reference.reshape_and_cache(want_k, value, want_key_cache, want_value_cache, slots, k_scale=0.5,
                                      v_scale=0.25)
    torch.testing.assert_close(rotated_q, want_q)
    # One fp8 ulp where a fused native rotary rounds in another order than the reference (the contract allows).
    diff = (key_cache.view(torch.uint8).int() - want_key_cache.view(torch.uint8).int()).abs()
    assert int(diff.max()) <= 1
    assert torch.equal(value_cache.view(torch.uint8), want_value_cache.view(torch.uint8))


def test_kv_cache_dtype_names_map_to_cache_dtypes():
    assert kv8.cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv8.cache_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv8.cache_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv8.cache_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
