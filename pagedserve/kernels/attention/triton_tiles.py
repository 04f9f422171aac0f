"""The @triton.jit helpers a tile of the paged attention kernels (triton.py) runs: finding a tile's sequence, the
online-softmax accumulation over a key range with its causal / window / bidirectional-range mask, tanh, fp8 widening.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_sequence(
    cu_seqlens_q_ptr,  # [S + 1] int32
    num_seqs,
    pid,
    BLOCK_Q: tl.constexpr,
):
    """Largest s whose first query tile index (cu_seqlens_q[s] // BLOCK_Q + s) is <= pid."""
    lo = pid * 0
    hi = pid * 0 + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= pid, mid + 1, lo)
        hi = tl.where(first_tile <= pid, hi, mid)
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh through exp2 (the interpreter and every GPU have it); the clamp keeps exp2 finite, tanh(20) is 1 in fp32."""
    return 1.0 - 2.0 / (tl.exp2(tl.minimum(x, 20.0) * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _widen(x, DOT_DTYPE: tl.constexpr):
    """A K/V tile in the dot's dtype; fp8 through fp16, which holds both formats exactly (sm_90 converts pairs)."""
    if x.dtype.is_fp8():
        x = x.to(tl.float16)
    return x.to(DOT_DTYPE)


@triton.jit
def _attend_range(
    q,  # [BLOCK_M, HEAD_PAD] query tile, already in DOT_DTYPE
    acc,  # [BLOCK_M, HEAD_PAD] fp32 running numerator
    m_i,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i,  # [BLOCK_M] fp32 running denominator
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_table_ptr,  # [max_blocks] int32, this sequence's row
    kv_head,
    q_pos,  # [BLOCK_M] absolute position of each row's query token
    q_lo,  # [BLOCK_M] each row's bidirectional range [q_lo, q_hi); read only when RANGED and MASKED
    q_hi,
    key_start,
    key_end,  # keys in [key_start, key_end) are visited
    seq_len,
    qk_scale,  # softmax scale * log2(e); with SOFT_CAP, softmax scale / cap
    window,  # sliding window (keys q_pos - window < k <= q_pos); read only when WINDOWED and MASKED
    soft_cap,  # cap * log2(e); read only when SOFT_CAP
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of both tl.dot calls
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # False: the caller guarantees every key in range is visible to every row
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    RANGED: tl.constexpr,  # rows also see the keys of their bidirectional range (Gemma 3's image runs)
):
    """Online-softmax accumulation of the keys in [key_start, key_end), causal (or in the row's range, when
    RANGED) and windowed per row when MASKED; scores soft-capped (cap * tanh(score / cap)) when SOFT_CAP."""
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(key_start, key_end, BLOCK_N):
        key_pos = start + offs_n  # [BLOCK_N]
        key_valid = key_pos < key_end
        if MASKED:
            block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
            kv_mask = key_valid[:, None] & d_mask[None, :]
        else:
            block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE)
            kv_mask = d_mask[None, :]
        block_ids = block_ids.to(tl.int64)
        in_block = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_off = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N] int64
        v_off = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = _widen(tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0), DOT_DTYPE)
        v = _widen(tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0), DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP:
            s = _tanh(s) * soft_cap
        if MASKED:
            visible = key_pos[None, :] <= q_pos[:, None]
            if RANGED:
                visible = visible | ((key_pos[None, :] >= q_lo[:, None]) & (key_pos[None, :] < q_hi[:, None]))
            visible = visible & (key_pos[None, :] < seq_len) & key_valid[None, :]
            if WINDOWED:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
