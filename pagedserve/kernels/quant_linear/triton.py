"""W8A16 / W4A16 in Triton: the weight tile is dequantized in registers inside the GEMM, so only its integers
(and per-group scales) cross the memory bus. One kernel serves decode (M = 1) and prefill rows."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant_linear.layout import QuantizedWeight

_BLOCK_K = 32  # divides every group size that checkpoints use (32 / 64 / 128), so a K tile has one scale per row


@triton.jit
def _quant_linear_kernel(
    out_ptr,  # [M, N] in x's dtype
    x_ptr,  # [M, K]
    q_ptr,  # int8 [N, K] or uint8 [N, ceil(K / 2)] (even k in the low nibble)
    scales_ptr, offsets_ptr,  # [N, G]
    bias_ptr,  # [N] or a dummy
    M, N, K,
    stride_xm, stride_om, stride_qn, stride_sn, stride_on,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TILE_IN_ONE_GROUP: tl.constexpr,  # every K tile lies inside one group: one scale per output row
    IEEE: tl.constexpr,  # fp32 activations: exact fp32 products, not tf32
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): acc += x tile @ (q * scale + offset) tile, fp32 sums."""
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    in_m, in_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=in_m[:, None] & in_k[None, :],
                    other=0.0)
        w_mask = in_k[:, None] & in_n[None, :]
        if BITS == 8:
            q = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None], mask=w_mask, other=0)
        else:
            byte = tl.load(q_ptr + offs_n[None, :] * stride_qn + (offs_k // 2)[:, None], mask=w_mask, other=0)
            q = (byte >> ((offs_k % 2) * 4)[:, None].to(tl.uint8)) & 15
        if TILE_IN_ONE_GROUP:
            s_offs = offs_n[None, :] * stride_sn + k0 // GROUP
            o_offs = offs_n[None, :] * stride_on + k0 // GROUP
            s_mask = in_n[None, :]
        else:
            s_offs = offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None]
            o_offs = offs_n[None, :] * stride_on + (offs_k // GROUP)[:, None]
            s_mask = w_mask
        w = q.to(tl.float32) * tl.load(scales_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + o_offs, mask=s_mask, other=0.0).to(tl.float32)
        # Rounded to the activations' dtype as the reference rounds its dequantized weight.
        w = tl.where(w_mask, w, 0.0).to(x_ptr.dtype.element_ty).to(DOT_DTYPE)
        x = x.to(DOT_DTYPE)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.quant_linear.quant_linear: programs over (row tile, output tile)."""
    q, (scales, offsets) = weight.canonical_qweight(), weight.params()
    assert x.shape[-1] == weight.in_features and q.stride(-1) == 1, "x must be [..., K]; qweight rows contiguous"
    assert scales.stride(-1) == 1 and (offsets is None or offsets.stride(-1) == 1)
    rows = x.reshape(-1, weight.in_features).contiguous()
    m, n, k = rows.shape[0], weight.out_features, weight.in_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else 64
        block_n = 64 if m <= 16 else 128
        has_offsets = offsets is not None
        offsets = offsets if has_offsets else scales
        _quant_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            out, rows, q, scales, offsets, bias if bias is not None else scales,
            m, n, k, rows.stride(0), out.stride(0), q.stride(0), scales.stride(0), offsets.stride(0),
            GROUP=weight.group_size, BITS=weight.bits, HAS_OFFSETS=has_offsets,
            HAS_BIAS=bias is not None, TILE_IN_ONE_GROUP=weight.group_size % _BLOCK_K == 0 or weight.group_size >= k,
            IEEE=_dot_dtype(x.dtype) == tl.float32, DOT_DTYPE=_dot_dtype(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, num_warps=4,
        )
    return out.view(*x.shape[:-1], n)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The activations' dtype, except bf16 under the CPU interpreter, whose bf16 tl.dot is wrong (triton 3.9)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting):
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16
