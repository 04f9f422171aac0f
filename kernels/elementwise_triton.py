"""Row-wise Triton kernels: neox rotary embedding, RMSNorm with fused residual add, SiLU-and-mul.

Each rounds intermediate results to the input dtype where transformers does, so bf16 outputs match it.
"""

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


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H]
    residual_out_ptr,  # [T, H] x + residual (unused without residual)
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (unused without residual)
    weight_ptr,  # [H]
    eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Grid (T,): one row's (fused residual add and) RMSNorm, statistics in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2I] rows [gate | up]
    stride_x, stride_o,
    INTERMEDIATE,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): silu(gate) rounded to the dtype, times up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding; returns new contiguous (query, key)."""
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


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with residual returns (norm(x + residual), x + residual)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with unit last stride"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), "weight must be [H] contiguous"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_in = residual if residual is not None else x
    res_out = torch.empty_like(out) if residual is not None else out
    assert res_in.shape == x.shape and res_in.stride(-1) == 1, "residual must be [T, H] like x"
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            out, res_out, x, res_in, weight, eps,
            x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
            HAS_RESIDUAL=residual is not None, num_warps=8,
        )
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up over the two halves of the last dimension."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, "x must be [T, 2I]"
    intermediate = x.shape[1] // 2
    out = torch.empty(x.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(intermediate, block))](
            out, x, x.stride(0), out.stride(0), intermediate, BLOCK=block, num_warps=4,
        )
    return out
