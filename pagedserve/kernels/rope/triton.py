"""Neox rotary embedding in Triton, rounding each product to the input dtype where transformers does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    """Rotate every head of one token: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]."""
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
    dst = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, (a1 - b1).to(dtype), mask=mask)
    tl.store(dst + HALF, (a2 + b2).to(dtype), mask=mask)


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
    offs_d = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + pos * stride_cs + offs_d
    # The cache is cast to the model dtype first, as the reference and transformers do.
    cos = tl.load(row, mask=offs_d < HALF, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(row + HALF, mask=offs_d < HALF, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(q_out_ptr, q_ptr, token, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_out_ptr, k_ptr, token, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)



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

