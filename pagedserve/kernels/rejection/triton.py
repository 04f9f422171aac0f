"""Rejection sampling in Triton: one program per sequence walks its drafts' acceptance tests (two loads
each), then sweeps the vocabulary twice at the one position that draws (the residual's total, then the
first token whose running sum passes u * total), so nothing of [B, K + 1, V] leaves the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rejection_kernel(
    out_ptr,  # [B, K + 1] int64
    draft_ids_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B] int64
    draft_probs_ptr,  # [B, K, V] fp32 (unread without HAS_Q)
    target_ptr,  # [B, K + 1, V] fp32
    uniforms_ptr,  # [B, K + 1] float64
    K, VOCAB,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (B,): accept draft i while u_i * q_i(d) < p_i(d); draw at the first position that does not."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_drafts_ptr + b)
    first = n
    for i in range(0, K):
        d = tl.load(draft_ids_ptr + b * K + i, mask=i < n, other=0)
        p = tl.load(target_ptr + (b * (K + 1) + i) * VOCAB + d, mask=i < n, other=0.0).to(tl.float64)
        q = 1.0
        if HAS_Q:
            q = tl.load(draft_probs_ptr + (b * K + i) * VOCAB + d, mask=i < n, other=1.0).to(tl.float64)
        u = tl.load(uniforms_ptr + b * (K + 1) + i)
        rejected = (i < n) & (u * q >= p) & (first == n)
        first = tl.where(rejected, i, first)
        tl.store(out_ptr + b * (K + 1) + i, tl.where(i < first, d, -1))
    is_bonus = first == n
    at = tl.minimum(first, tl.maximum(K - 1, 0))
    d = tl.load(draft_ids_ptr + b * K + at, mask=~is_bonus, other=-1)  # K = 0: always the bonus
    u = tl.load(uniforms_ptr + b * (K + 1) + first)
    if not is_bonus:
        p = tl.load(target_ptr + (b * (K + 1) + first) * VOCAB + d).to(tl.float64)
        q = 1.0
        if HAS_Q:
            q = tl.load(draft_probs_ptr + (b * K + first) * VOCAB + d).to(tl.float64)
        ratio = tl.where(q > 0, p / q, 0.0)
        ratio = tl.minimum(ratio, 1.0)
        u = tl.minimum(tl.maximum((u - ratio) / (1.0 - ratio), 0.0), 1.0)
    row = target_ptr + (b * (K + 1) + first) * VOCAB
    q_row = draft_probs_ptr + (b * K + at) * VOCAB
    q_end = tl.where(is_bonus, 0, VOCAB)
    total = tl.zeros([], dtype=tl.float64)
    total_p = tl.zeros([], dtype=tl.float64)
    for start in range(0, VOCAB, BLOCK):
        w, pw = _residual(row, q_row, start, VOCAB, d, q_end, HAS_Q, BLOCK)
        total += tl.sum(w, axis=0)
        total_p += tl.sum(pw, axis=0)
    use_p = total <= 0  # rounding left nothing of p - q: draw from p
    total = tl.where(use_p, total_p, total)
    target = u * total
    token = VOCAB
    last = VOCAB  # the last token of non-zero weight, should u * total round to the total
    running = tl.zeros([], dtype=tl.float64)
    for start in range(0, VOCAB, BLOCK):
        w, pw = _residual(row, q_row, start, VOCAB, d, q_end, HAS_Q, BLOCK)
        w = tl.where(use_p, pw, w)
        cdf = running + tl.cumsum(w, axis=0)
        offs = start + tl.arange(0, BLOCK)
        token = tl.minimum(token, tl.min(tl.where((cdf > target) & (offs < VOCAB), offs, VOCAB), axis=0))
        last = tl.where(tl.max(tl.where(w > 0, offs, -1), axis=0) >= 0,
                        tl.max(tl.where(w > 0, offs, -1), axis=0), last)
        running += tl.sum(w, axis=0)
    token = tl.where(token == VOCAB, last, token)
    tl.store(out_ptr + b * (K + 1) + first, token.to(tl.int64))
    for i in range(0, K + 1):
        if i > first:
            tl.store(out_ptr + b * (K + 1) + i, -1)


@triton.jit
def _residual(row, q_row, start, VOCAB, d, q_end, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    """One tile of the weights drawn from (max(0, p - q); p at the bonus position, where q_end = 0 and
    d = -1) and of p itself."""
    offs = start + tl.arange(0, BLOCK)
    p = tl.load(row + offs, mask=offs < VOCAB, other=0.0).to(tl.float64)
    if HAS_Q:
        q = tl.load(q_row + offs, mask=offs < q_end, other=0.0).to(tl.float64)
    else:
        q = tl.where(offs == d, 1.0, 0.0).to(tl.float64)
    return tl.maximum(p - q, 0.0), p


def rejection_sample(draft_ids: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """kernels.rejection.rejection_sample with one program per sequence."""
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    assert target_probs.shape == (batch, k + 1, vocab) and target_probs.dtype == torch.float32
    assert uniforms.dtype == torch.float64 and uniforms.shape == (batch, k + 1)
    assert draft_probs is None or (draft_probs.shape == (batch, k, vocab) and draft_probs.dtype == torch.float32)
    out = torch.empty((batch, k + 1), dtype=torch.int64, device=target_probs.device)
    if batch:
        q = draft_probs.contiguous() if draft_probs is not None else target_probs
        _rejection_kernel[(batch,)](
            out, draft_ids.contiguous(), num_drafts.to(torch.int64).contiguous(), q, target_probs.contiguous(),
            uniforms.contiguous(), k, vocab, HAS_Q=draft_probs is not None,
            BLOCK=min(1024, triton.next_power_of_2(vocab)), num_warps=4,
        )
    return out
