"""The bitmask op in Triton: one program per (masked row, vocabulary tile), reading each word once per
token, so the mask never leaves the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [R, V]
    bitmask_ptr,  # [N, W] int32
    rows_ptr,  # [N] int64
    stride_logits, stride_bitmask,
    VOCAB,
    BLOCK: tl.constexpr,
):
    """Grid (N, cdiv(V, BLOCK)): -inf where the token's bit is clear."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < VOCAB
    row = tl.load(rows_ptr + i)
    words = tl.load(bitmask_ptr + i * stride_bitmask + offs // 32, mask=in_vocab, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_logits + offs
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """kernels.bitmask.apply_token_bitmask: masked stores only, the allowed logits are not touched."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [R, V], rows contiguous"
    assert bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1, "bitmask must be int32 [N, W]"
    if rows.numel():
        vocab = logits.shape[1]
        block = min(4096, triton.next_power_of_2(vocab))
        _apply_token_bitmask_kernel[(rows.numel(), triton.cdiv(vocab, block))](
            logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab, BLOCK=block, num_warps=4,
        )
