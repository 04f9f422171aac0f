"""The fused MoE forward in Triton, the vLLM shape: the (token, expert) pairs sorted by expert and padded to
the row block (`align.py`), one expert per block, and two grouped GEMM kernels over that layout. The first
reads each pair's token row of x and computes gate and up tiles of w13 together, writing SiLU(gate) * up; the
second multiplies by w2 and the pair's routing weight. The k pairs of each token are summed at the end."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.moe.align import align_block_size


@triton.jit
def _moe_gemm_kernel(
    out_ptr,  # [P, N] one row per (token, expert) pair
    a_ptr,  # [T, K] rows read at pair // A_ROW_DIV
    b_ptr,  # [E, N (x2 when GATED), K]
    weights_ptr,  # [P] routing weight per pair
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] pair indices, P for padding
    block_expert_ptr,  # [num_blocks] expert per block, -1 past the last group
    N, K, P, A_ROW_DIV,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_om, stride_on,
    GATED: tl.constexpr,  # b holds [gate | up] rows: write SiLU(a @ gate.T) * (a @ up.T)
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands: exact fp32 products, not tf32
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (num_blocks, cdiv(N, BLOCK_N)): one expert's rows times its weight tile; padding blocks return."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < P
    rows = pairs // A_ROW_DIV
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    in_n = offs_n < N
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & in_k[None, :], other=0.0).to(DOT_DTYPE)
        b_mask = in_k[:, None] & in_n[None, :]
        b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0).to(DOT_DTYPE)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if GATED:
            up = tl.load(b_base + N * stride_bn + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0).to(DOT_DTYPE)
            acc_up += tl.dot(a, up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    # Rounded to the model's dtype where transformers rounds: the projections, SiLU, the expert's output.
    res = acc.to(dtype).to(tl.float32)
    if GATED:
        act = (res / (1.0 + tl.exp(-res))).to(dtype).to(tl.float32)
        res = act * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        res = res * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on, res.to(dtype),
             mask=valid[:, None] & in_n[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe.fused_moe: align the pairs, then the gated w13 GEMM and the weighted w2 GEMM."""
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, "x, w13, w2 must be row-contiguous"
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if pairs <= 256 else 64
    align = align_block_size(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    activated = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _launch(activated, x, w13, weights, align, inter, hidden, top_k, gated=True)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(down, activated, w2, weights, align, hidden, inter, 1, gated=False)
    return down.view(tokens, top_k, hidden).sum(dim=1)


def _launch(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor, align, n: int, k: int,
            a_row_div: int, gated: bool) -> None:
    """One grouped GEMM over the aligned pairs: out[pair] = f(a[pair // a_row_div] @ b[expert].T)."""
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (align.block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        out, a, b, weights, align.sorted_ids, align.block_expert, n, k, align.num_pairs, a_row_div,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        GATED=gated, MUL_WEIGHT=not gated, PRECISION="ieee" if a.dtype == torch.float32 else "tf32", DOT_DTYPE=_dot_dtype(a.dtype),
        BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operands' dtype, except bf16 under the CPU interpreter, whose bf16 tl.dot is wrong."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting):
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16
