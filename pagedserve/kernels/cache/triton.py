"""Triton kernels that write the paged KV cache: reshape_and_cache and copy_blocks (copy-on-write).

An fp8 cache (float8_e4m3fn, float8_e5m2) stores x / scale rounded to nearest even and saturated at the format's
largest finite value, byte for byte what torch's `(x.float() / scale).clamp(-max, max).to(fp8)` stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTS_FP8_KV = True
# mantissa bits, exponent bias
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds 8-bit floats with per-tensor scales."""
    return dtype in _FP8_FORMATS


def fp8_constexprs(dtype: torch.dtype) -> dict:
    """The constexprs of quantize_fp8 for a cache dtype (FP8_MANT 0: not an fp8 cache, values stored as cast)."""
    if not is_fp8(dtype):
        return dict(FP8_MANT=0, FP8_BIAS=0, FP8_MAX_BITS=0, FP8_MAX_BYTE=0)
    largest = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)
    mant, bias = _FP8_FORMATS[dtype]
    return dict(FP8_MANT=mant, FP8_BIAS=bias, FP8_MAX_BITS=int(largest.view(torch.int32)),
                FP8_MAX_BYTE=int(largest.to(dtype).view(torch.uint8)))


@triton.jit
def quantize_fp8(
    x,  # any float tensor
    scale,  # fp32 per-tensor scale
    MANT: tl.constexpr,  # mantissa bits: 3 (e4m3fn) or 2 (e5m2)
    BIAS: tl.constexpr,  # exponent bias: 7 or 15
    MAX_BITS: tl.constexpr,  # fp32 bits of the largest finite value
    MAX_BYTE: tl.constexpr,  # its fp8 byte
):
    """fp8 bytes (uint8) of x / scale: IEEE division, round to nearest even, saturated, NaN kept (0x7f).

    In integer arithmetic: the interpreter's float -> fp8 cast truncates and mis-carries, so only this path is
    proven here, and the GPU runs the same exact integer steps.
    """
    y = tl.math.div_rn(x.to(tl.float32), scale)
    u = y.to(tl.int32, bitcast=True)
    sign = tl.where(u < 0, 0x80, 0)
    a = u & 0x7FFFFFFF
    # Normal range: round the fp32 mantissa to MANT bits; a carry into the exponent is the right result.
    drop: tl.constexpr = 23 - MANT
    rounded = a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)
    normal = (rounded >> drop) - ((127 - BIAS) << MANT)
    # Below the smallest normal: |y| in units of the smallest subnormal 2^(1 - BIAS - MANT), to nearest even.
    exponent = (a >> 23) - 127
    significand = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(23 - (BIAS - 1 + MANT) - exponent, 1), 30)
    q = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)
    bits = tl.where(a < ((128 - BIAS) << 23), q, normal)
    bits = tl.where(a >= MAX_BITS, MAX_BYTE, bits)
    bits = tl.where(a > 0x7F800000, 0x7F, bits)
    return (bits | sign).to(tl.uint8)


@triton.jit
def store_cache_row(
    ptr,  # the row's first element in a cache (any dtype)
    offs,
    x,  # values in the activation dtype
    scale,
    mask,
    FP8_MANT: tl.constexpr,  # 0: not an fp8 cache
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
    FP8_MAX_BYTE: tl.constexpr,
):
    """Store x into a cache: cast to the cache dtype, or for an fp8 cache quantized by scale."""
    if FP8_MANT > 0:
        bits = quantize_fp8(x, scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS, FP8_MAX_BYTE)
        tl.store(ptr + offs, bits.to(ptr.dtype.element_ty, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv * D] rows of the new keys
    value_ptr,  # [T, Hkv * D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv * D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv * D]
    slot_mapping_ptr,  # [T] int64
    k_scale,  # read only for an fp8 cache
    v_scale,
    stride_kt, stride_vt,
    stride_kcb, stride_kcs,
    stride_vcb, stride_vcs,
    ROW: tl.constexpr,  # Hkv * D
    ROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
    FP8_MAX_BYTE: tl.constexpr,
):
    """Grid (T,): copy one token's K and V rows into its slot (quantized into an fp8 cache); slot -1 means padding
    and is skipped."""
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
    store_cache_row(key_cache_ptr + block * stride_kcb + in_block * stride_kcs, offs, k, k_scale, mask,
                    FP8_MANT, FP8_BIAS, FP8_MAX_BITS, FP8_MAX_BYTE)
    store_cache_row(value_cache_ptr + block * stride_vcb + in_block * stride_vcs, offs, v, v_scale, mask,
                    FP8_MANT, FP8_BIAS, FP8_MAX_BITS, FP8_MAX_BYTE)


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


def check_scales(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Scales belong to fp8 caches: both caches of one dtype, positive finite scales, 1.0 for any other cache."""
    assert key_cache.dtype == value_cache.dtype, "key and value caches differ in dtype"
    if is_fp8(key_cache.dtype):
        assert 0 < k_scale < float("inf") and 0 < v_scale < float("inf"), "k_scale/v_scale must be positive"
    else:
        assert k_scale == v_scale == 1.0, "k_scale/v_scale apply to an fp8 cache only"


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """kernels.cache.reshape_and_cache: one program per token; an fp8 cache stores key / k_scale, value / v_scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for t in (key, value):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "key/value rows must be [Hkv, D] contiguous"
    for c in (key_cache, value_cache):
        assert c.dim() == 4 and c.shape[2:] == (num_kv_heads, head_dim), "cache must be [NB, BS, Hkv, D]"
        assert c.stride(3) == 1 and c.stride(2) == head_dim, "cache slots must be [Hkv, D] contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() == num_tokens, "slot_mapping: [T] int64"
    check_scales(key_cache, value_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), float(k_scale), float(v_scale),
        key.stride(0), value.stride(0),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        ROW=row, ROW_PAD=triton.next_power_of_2(row), BLOCK_SIZE=key_cache.shape[1],
        **fp8_constexprs(key_cache.dtype), num_warps=4,
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
