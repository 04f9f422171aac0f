"""Neox rotary embedding in Triton, rounding each product to the input dtype where transformers does; alone, or
fused with the KV cache write (the rotated key goes straight into its slot, quantized for an fp8 cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.cache.triton import check_scales, fp8_constexprs, store_cache_row

SUPPORTS_FP8_KV = True


@triton.jit
def _rotate(
    x_ptr,  # [T, H, D]
    token,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    stride_xt, stride_xh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Every head of one token rotated, [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]: two [HEADS_PAD, HALF_PAD]
    halves in x's dtype, and their mask."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # transformers rounds each product to the model dtype before the add; so do we.
    a1 = (x1.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin[None, :]).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin[None, :]).to(dtype).to(tl.float32)
    return (a1 - b1).to(dtype), (a2 + b2).to(dtype), mask


@triton.jit
def _rotate_heads(
    out_ptr,  # [T, H, D] for this tensor
    x_ptr,  # [T, H, D]
    token,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    stride_xt, stride_xh,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate every head of one token into out."""
    r1, r2, mask = _rotate(x_ptr, token, cos, sin, stride_xt, stride_xh, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    dst = out_ptr + token * stride_ot + tl.arange(0, HEADS_PAD)[:, None] * stride_oh + tl.arange(0, HALF_PAD)[None, :]
    tl.store(dst, r1, mask=mask)
    tl.store(dst + HALF, r2, mask=mask)


@triton.jit
def _load_cos_sin(cos_sin_ptr, pos, stride_cs, dtype: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """A position's cos and sin halves, rounded to the model dtype first as the reference and transformers do."""
    offs_d = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + pos * stride_cs + offs_d
    cos = tl.load(row, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T] int64
    cos_sin_ptr,  # [max_pos, D] rows [cos(D/2) | sin(D/2)]
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Grid (T,): rotate all query and key heads of one token at its position."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, q_ptr.dtype.element_ty, HALF, HALF_PAD)
    _rotate_heads(q_out_ptr, q_ptr, token, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_out_ptr, k_ptr, token, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


@triton.jit
def _rotary_cache_kernel(
    q_out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,
    positions_ptr,  # [T] int64
    slot_mapping_ptr,  # [T] int64; -1 skipped
    cos_sin_ptr,  # [max_pos, D]
    k_scale,  # read only for an fp8 cache
    v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_vcb, stride_vcs,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
    FP8_MAX_BYTE: tl.constexpr,
):
    """Grid (T,): rotate one token's query heads into q_out, its key heads straight into its cache slot, and copy
    its value heads into theirs (both quantized for an fp8 cache)."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos, stride_cs, q_ptr.dtype.element_ty, HALF, HALF_PAD)
    _rotate_heads(q_out_ptr, q_ptr, token, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    k1, k2, mask = _rotate(k_ptr, token, cos, sin, stride_kt, stride_kh, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)
    # A slot's [Hkv, D] is contiguous in the cache.
    offs = tl.arange(0, KV_HEADS_PAD)[:, None] * (2 * HALF) + tl.arange(0, HALF_PAD)[None, :]
    k_dst = key_cache_ptr + (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * stride_kcs
    store_cache_row(k_dst, offs, k1, k_scale, mask, FP8_MANT, FP8_BIAS, FP8_MAX_BITS, FP8_MAX_BYTE)
    store_cache_row(k_dst, offs + HALF, k2, k_scale, mask, FP8_MANT, FP8_BIAS, FP8_MAX_BITS, FP8_MAX_BYTE)
    v_src = v_ptr + token * stride_vt + tl.arange(0, KV_HEADS_PAD)[:, None] * stride_vh + tl.arange(0, HALF_PAD)[None, :]
    v_dst = value_cache_ptr + (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vcs
    store_cache_row(v_dst, offs, tl.load(v_src, mask=mask), v_scale, mask, FP8_MANT, FP8_BIAS, FP8_MAX_BITS,
                    FP8_MAX_BYTE)
    store_cache_row(v_dst, offs + HALF, tl.load(v_src + HALF, mask=mask), v_scale, mask, FP8_MANT, FP8_BIAS,
                    FP8_MAX_BITS, FP8_MAX_BYTE)



def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.rope.rotary_embedding: one program per token; returns new contiguous (query, key)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.stride(-1) == 1 and key.stride(-1) == 1, "query/key need unit last stride"
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, "key must be [T, Hkv, D] like query"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, "cos_sin_cache: [max_pos, D]"
    assert cos_sin_cache.stride(1) == 1 and head_dim % 2 == 0, "cos_sin_cache rows must be contiguous"
    assert positions.numel() == num_tokens, "positions must be [T]"
    q_out, k_out = torch.empty_like(query, memory_format=torch.contiguous_format), torch.empty_like(
        key, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q_out, k_out, query, key, positions.contiguous(), cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        num_warps=8 if triton.next_power_of_2(num_q_heads) * half >= 2048 else 4,
    )
    return q_out, k_out


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """kernels.rope.rotary_embedding_and_cache in one launch: returns the rotated query; the rotated key and the
    value go into their slots (slot -1 skipped), an fp8 cache holding key / k_scale and value / v_scale."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    for t in (query, key, value):
        assert t.stride(-1) == 1 and t.shape[0] == num_tokens and t.shape[2] == head_dim, "[T, H, D], unit last stride"
    assert value.shape == key.shape, "value must be [T, Hkv, D] like key"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, "cos_sin_cache: [max_pos, D]"
    assert cos_sin_cache.stride(1) == 1 and head_dim % 2 == 0, "cos_sin_cache rows must be contiguous"
    for c in (key_cache, value_cache):
        assert c.dim() == 4 and c.shape[2:] == (num_kv_heads, head_dim), "cache must be [NB, BS, Hkv, D]"
        assert c.stride(3) == 1 and c.stride(2) == head_dim, "cache slots must be [Hkv, D] contiguous"
    assert positions.numel() == num_tokens, "positions must be [T]"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() == num_tokens, "slot_mapping: [T] int64"
    check_scales(key_cache, value_cache, k_scale, v_scale)
    q_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    _rotary_cache_kernel[(num_tokens,)](
        q_out, query, key, value, key_cache, value_cache, positions.contiguous(), slot_mapping.contiguous(),
        cos_sin_cache, float(k_scale), float(v_scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        q_out.stride(0), q_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=key_cache.shape[1],
        **fp8_constexprs(key_cache.dtype),
        num_warps=8 if triton.next_power_of_2(num_q_heads) * half >= 2048 else 4,
    )
    return q_out
