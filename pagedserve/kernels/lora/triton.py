"""The multi-LoRA shrink and expand in Triton, the punica shape without a host sync: a program per (row tile,
output tile) loads its rows' slots and runs one tl.dot pass per distinct adapter among them, with rows of
other slots masked out; a tile of base-model rows (-1) loads no weights. Rows may come in any order; given
`SlotGroups` they are visited sorted by slot, so a tile usually holds one adapter."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.lora.grouping import SlotGroups

_NO_SLOT = tl.constexpr(2147483647)  # above every slot: the end of a tile's walk over its distinct slots
_SHRINK_BLOCK_K = 128
_TARGET_PROGRAMS = 128  # about one per SM of an H100/H200: a decode shrink splits K to reach it


@triton.jit
def _tile_rows(slots_ptr, order_ptr, T, HAS_ORDER: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's row indices, whether each is a row, and each row's slot (-1 past the end)."""
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs < T
    if HAS_ORDER:
        rows = tl.load(order_ptr + offs, mask=in_m, other=0).to(tl.int64)
    else:
        rows = offs.to(tl.int64)
    row_slot = tl.load(slots_ptr + rows, mask=in_m, other=-1).to(tl.int32)
    return rows, in_m, row_slot


@triton.jit
def _lora_shrink_kernel(
    y_ptr,  # [T, R] in x's dtype, or [SPLIT_K, T, R] fp32 partial sums
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    slots_ptr,  # [T] int32 / int64
    order_ptr,  # [T] int64 rows sorted by slot, or a dummy
    T, K, R, K_PER_SPLIT,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ys, stride_yt, stride_yr,
    HAS_ORDER: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products, not tf32
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), cdiv(R, BLOCK_R), SPLIT_K): y[rows] = x[rows] @ A[slot].T per slot over this
    program's K_PER_SPLIT columns, zeros for -1."""
    rows, in_m, row_slot = _tile_rows(slots_ptr, order_ptr, T, HAS_ORDER, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = offs_r < R
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    slot = tl.min(tl.where(row_slot >= 0, row_slot, _NO_SLOT))
    while slot < _NO_SLOT:
        mine = row_slot == slot
        a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < k_end
            # Rows of other slots load zeros, so each pass adds only to its own rows.
            x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                        mask=mine[:, None] & in_k[None, :], other=0.0).to(DOT_DTYPE)
            a = tl.load(a_base + offs_k[:, None] * stride_ak, mask=in_r[None, :] & in_k[:, None],
                        other=0.0).to(DOT_DTYPE)
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        slot = tl.min(tl.where(row_slot > slot, row_slot, _NO_SLOT))
    tl.store(y_ptr + tl.program_id(2) * stride_ys + rows[:, None] * stride_yt + offs_r[None, :] * stride_yr, acc.to(y_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_r[None, :])


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, N_total], columns offset..offset+N added to
    y_ptr,  # [T, R]
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32 / int64
    order_ptr,  # [T] int64 rows sorted by slot, or a dummy
    T, N, R, offset,
    stride_ot, stride_on, stride_yt, stride_yr, stride_bs, stride_bn, stride_br,
    HAS_ORDER: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)): out[rows, offset + n] += y[rows] @ B[slot].T, fp32 sums;
    rows of slot -1 are neither read nor written."""
    rows, in_m, row_slot = _tile_rows(slots_ptr, order_ptr, T, HAS_ORDER, BLOCK_M)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    in_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    slot = tl.min(tl.where(row_slot >= 0, row_slot, _NO_SLOT))
    while slot < _NO_SLOT:
        mine = row_slot == slot
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            in_r = offs_r < R
            y = tl.load(y_ptr + rows[:, None] * stride_yt + offs_r[None, :] * stride_yr,
                        mask=mine[:, None] & in_r[None, :], other=0.0).to(DOT_DTYPE)
            b = tl.load(b_base + offs_r[:, None] * stride_br, mask=in_r[:, None] & in_n[None, :],
                        other=0.0).to(DOT_DTYPE)
            if IEEE:
                acc += tl.dot(y, b, input_precision="ieee")
            else:
                acc += tl.dot(y, b)
        slot = tl.min(tl.where(row_slot > slot, row_slot, _NO_SLOT))
    active = (in_m & (row_slot >= 0))[:, None] & in_n[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + (offset + offs_n)[None, :] * stride_on
    base = tl.load(out_ptrs, mask=active, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=active)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                groups: SlotGroups | None = None) -> torch.Tensor:
    """kernels.lora.lora_shrink: programs over (row tile, rank tile, K split); a batch of few row tiles splits
    K across programs into fp32 partial sums, added up after."""
    t, k = x.shape
    rank = lora_a.shape[1]
    if t == 0:
        return x.new_empty(0, rank)
    block_m = 16 if t <= 16 else 64
    block_r = min(64, max(16, triton.next_power_of_2(rank)))
    grid_mr = (triton.cdiv(t, block_m), triton.cdiv(rank, block_r))
    k_tiles = triton.cdiv(k, _SHRINK_BLOCK_K)
    wanted = max(1, min(k_tiles, _TARGET_PROGRAMS // (grid_mr[0] * grid_mr[1])))
    k_per_split = triton.cdiv(k_tiles, wanted) * _SHRINK_BLOCK_K
    split = triton.cdiv(k, k_per_split)
    y = (torch.empty(t, rank, dtype=x.dtype, device=x.device) if split == 1
         else torch.empty(split, t, rank, dtype=torch.float32, device=x.device))
    order = groups.order if groups is not None else slots
    _lora_shrink_kernel[(*grid_mr, split)](
        y, x, lora_a, slots, order, t, k, rank, k_per_split,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        y.stride(0) if split > 1 else 0, y.stride(-2), y.stride(-1),
        HAS_ORDER=groups is not None, IEEE=x.dtype == torch.float32, DOT_DTYPE=_dot_dtype(x.dtype),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=_SHRINK_BLOCK_K, num_warps=4,
    )
    return y if split == 1 else y.sum(0).to(x.dtype)


def lora_expand_add(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                    offset: int = 0, groups: SlotGroups | None = None) -> None:
    """kernels.lora.lora_expand_add: programs over (row tile, output tile), the whole rank in each."""
    t, rank = y.shape
    n = lora_b.shape[1]
    if t == 0:
        return
    block_m = 16 if t <= 16 else 64
    block_n = 64 if t <= 16 else 128
    block_r = min(64, max(16, triton.next_power_of_2(rank)))
    order = groups.order if groups is not None else slots
    _lora_expand_kernel[(triton.cdiv(t, block_m), triton.cdiv(n, block_n))](
        out, y, lora_b, slots, order, t, n, rank, offset,
        out.stride(0), out.stride(1), y.stride(0), y.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        HAS_ORDER=groups is not None, IEEE=y.dtype == torch.float32, DOT_DTYPE=_dot_dtype(y.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4 if block_m == 16 else 8,
    )


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operands' dtype, except bf16 under the CPU interpreter, whose bf16 tl.dot is wrong (triton 3.9)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting):
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16
