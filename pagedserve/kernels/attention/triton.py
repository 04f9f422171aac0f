"""Paged attention in Triton: one kernel for prefill chunks and decodes, plus a split-K decode variant.

Layouts as in kernels.attention.paged_attention. A program owns one KV head and a tile of BLOCK_M rows; a row is one
(query token, query head of that KV head's group), so a K/V tile loaded once serves the whole GQA group.
Every address that involves a block id or a token index is computed in int64.
An fp8 cache (float8_e4m3fn, float8_e5m2) is read as stored * scale: K/V tiles are widened in registers, k_scale is
folded into the score scale and v_scale into the output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention.triton_tiles import _attend_range, _find_sequence
from pagedserve.kernels.cache.triton import check_scales, is_fp8

SUPPORTS_FP8_KV = True
SUPPORTS_BIDIRECTIONAL = True  # per-row ranges masked inside the prefill tile loop (RANGED)
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int32
    cu_seqlens_q_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    ranges_ptr,  # [T, 2] each token's bidirectional [lo, hi); read only when RANGED
    num_seqs,
    qk_scale,  # with k_scale folded in
    window,
    soft_cap,
    v_scale,  # multiplies the output (1.0 unless the cache is fp8)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_rt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q * GROUP, padded to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per inner step
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    RANGED: tl.constexpr,  # bidirectional ranges given
):
    """Grid (query tiles over all sequences, KV heads); causal attention of one tile over its context (and each
    row's bidirectional range: the tile's keys then run to the furthest range end, masked per row)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] index inside this sequence's chunk
    q_head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    io_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask, other=0.0,
    ).to(DOT_DTYPE)

    q_pos = context_len + q_idx
    last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_end = tl.minimum(context_len + last_q + 1, seq_len)
    q_lo = q_pos
    q_hi = q_pos
    if RANGED:
        # A range's keys before the tile's first query are visible anyway: only the masked sections read it.
        q_lo = tl.load(ranges_ptr + token * stride_rt, mask=row_valid, other=0).to(tl.int32)
        q_hi = tl.load(ranges_ptr + token * stride_rt + 1, mask=row_valid, other=0).to(tl.int32)
        key_end = tl.minimum(tl.maximum(key_end, tl.max(q_hi, axis=0)), seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys before the tile's first query position are visible to every row: no mask work for them.
    first_pos = context_len + q_tile * BLOCK_Q
    unmasked_end = first_pos // BLOCK_N * BLOCK_N
    band_start = 0
    if WINDOWED:
        # Keys before the first row's window are skipped; from the last row's window start (rounded up to a
        # tile) to unmasked_end every row sees every key; the ragged edges before and after are masked.
        key_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        band_start = tl.minimum(
            (tl.maximum(context_len + last_q - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, key_end
        )
        unmasked_end = tl.maximum(unmasked_end, band_start)
        acc, m_i, l_i = _attend_range(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, q_pos, q_lo, q_hi, key_lo, band_start,
            seq_len, qk_scale, window, soft_cap, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, True, True, SOFT_CAP, RANGED,
        )
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, q_pos, q_lo, q_hi, band_start, unmasked_end,
        seq_len, qk_scale, window, soft_cap, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, False, False, SOFT_CAP, False,
    )
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, q_pos, q_lo, q_hi, unmasked_end, key_end,
        seq_len, qk_scale, window, soft_cap, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, True, WINDOWED, SOFT_CAP, RANGED,
    )
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None] * v_scale
    tl.store(
        out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=io_mask,
    )


@triton.jit
def _split_decode_kernel(
    part_acc_ptr,  # [S, Hq, NUM_SPLITS, HEAD_PAD] fp32 unnormalised numerators
    part_ml_ptr,  # [S, Hq, NUM_SPLITS, 2] fp32 (running max in log2 domain, denominator)
    q_ptr,  # [S, Hq, D], one decode token per sequence
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    keys_per_split,
    qk_scale,
    window,
    soft_cap,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """Grid (S, Hkv, NUM_SPLITS): one decode token's GQA group over one slice of its context (of its window)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    key_start = split * keys_per_split
    if WINDOWED:
        key_start += tl.maximum(seq_len - window, 0)
    key_end = tl.minimum(key_start + keys_per_split, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    row_valid = offs_m < GROUP
    q_head = kv_head * GROUP + offs_m
    q_mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seq * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    ).to(DOT_DTYPE)
    q_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # A decode query sees its whole context (window): only the ragged last tile of the split needs a mask.
    unmasked_end = key_start + tl.maximum(key_end - key_start, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, q_pos, q_pos, q_pos, key_start, unmasked_end,
        seq_len, qk_scale, window, soft_cap, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, False, False, SOFT_CAP, False,
    )
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, q_pos, q_pos, q_pos, unmasked_end, key_end,
        seq_len, qk_scale, window, soft_cap, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, True, False, SOFT_CAP, False,
    )
    row = (seq * (GROUP * tl.num_programs(1)) + q_head) * NUM_SPLITS + split  # [BLOCK_M] int64
    tl.store(part_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _split_reduce_kernel(
    out_ptr,  # [S, Hq, D]
    part_acc_ptr,  # [S, Hq, NUM_SPLITS, HEAD_PAD] fp32
    part_ml_ptr,  # [S, Hq, NUM_SPLITS, 2] fp32
    v_scale,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Grid (S, Hq): rescale each split's partial result to the global max and normalise."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(part_ml_ptr + (row0 + offs_s) * 2)  # [NUM_SPLITS]
    l_s = tl.load(part_ml_ptr + (row0 + offs_s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    # Empty splits carry m = -inf and weigh exactly 0; split 0 always holds the first visible key, so m_max is
    # finite.
    w = tl.exp2(m - m_max)
    acc = tl.load(part_acc_ptr + (row0 + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0) * v_scale
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _dot_dtype(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> tl.dtype:
    """The cache dtype (the query's for an fp8 cache, whose values it holds exactly), except bf16 under the CPU
    interpreter, whose bf16 tl.dot is wrong (triton 3.9)."""
    if is_fp8(cache_dtype):
        cache_dtype = query_dtype
    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    if cache_dtype == torch.float32 or (cache_dtype == torch.bfloat16 and interpreting):
        return tl.float32
    return tl.float16 if cache_dtype == torch.float16 else tl.bfloat16


def _block_n(max_seqlen_k: int, head_pad: int) -> int:
    """Keys per inner step: 64, fewer for short contexts or head sizes above 128 (shared memory)."""
    if max_seqlen_k < 64:
        return 16
    return 64 if head_pad <= 128 else 32


def _num_decode_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
    """Split the context only when (sequence, KV head) programs cannot fill the GPU and contexts are long."""
    if device.type != "cuda" or max_seqlen_k < 1024:
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    # Each split should keep at least 256 keys so the reduction stays cheap.
    return max(1, min(splits, 64, triton.next_power_of_2(max_seqlen_k // 256)))


def _check_layouts(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    assert query.dim() == 3 and query.stride(-1) == 1, "query must be [T, Hq, D] with unit last stride"
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, "caches must be [NB, BS, Hkv, D]"
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need unit last stride"
    assert key_cache.shape[-1] == query.shape[-1], "query and cache head sizes differ"
    assert query.shape[1] % key_cache.shape[2] == 0, "query heads must be a multiple of KV heads"
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1, "block_tables: int32 rows"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous(), "cu_seqlens_q: int32"
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "seq_lens: int32"
    assert cu_seqlens_q.numel() == seq_lens.numel() + 1 == block_tables.shape[0] + 1, "batch sizes differ"


def _check_ranges(ranges: torch.Tensor | None, num_tokens: int) -> torch.Tensor | None:
    if ranges is not None:
        assert ranges.shape == (num_tokens, 2) and ranges.stride(1) == 1, "bidirectional_ranges: [T, 2] rows"
        assert ranges.dtype in (torch.int32, torch.int64), "bidirectional_ranges: int32 or int64"
    return ranges


@dataclass(frozen=True, slots=True)
class _Launch:
    """One call's tensors and what its kernel launches share: layout sizes, log2-domain scale, dot settings."""

    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    qk_scale: float
    v_scale: float
    head_pad: int
    dot_dtype: tl.dtype
    window: int  # 0: no sliding window
    soft_cap: float  # cap * log2(e); 0: no soft-capping
    ranges: torch.Tensor | None = None  # [T, 2] bidirectional [lo, hi) per token; None: causal only

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.query.shape[1] // self.key_cache.shape[2]

    def strides(self) -> tuple[int, ...]:
        """The kernels' stride arguments after the query's: K's and V's block/slot/head, the block table's."""
        return (*self.key_cache.stride()[:3], *self.value_cache.stride()[:3], self.block_tables.stride(0))

    def constexprs(self) -> dict:
        """The constexpr arguments both attention kernels take."""
        return dict(GROUP=self.group, HEAD_DIM=self.query.shape[2], HEAD_PAD=self.head_pad,
                    BLOCK_SIZE=self.key_cache.shape[1], DOT_DTYPE=self.dot_dtype,
                    DOT_PRECISION="ieee" if self.dot_dtype == tl.float32 else "tf32",
                    WINDOWED=self.window > 0, SOFT_CAP=self.soft_cap > 0)

    def split_decode(self, max_seqlen_k: int, num_splits: int) -> None:
        """One decode token per sequence, its context cut into num_splits (a power of two) slices, reduced."""
        query, out = self.query, self.out
        num_seqs, num_q_heads = query.shape[0], query.shape[1]
        block_n = _block_n(max_seqlen_k, self.head_pad)
        keys_per_split = triton.cdiv(triton.cdiv(max_seqlen_k, num_splits), block_n) * block_n
        part_acc = torch.empty(num_seqs, num_q_heads, num_splits, self.head_pad, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(num_seqs, num_q_heads, num_splits, 2, dtype=torch.float32, device=query.device)
        _split_decode_kernel[(num_seqs, self.key_cache.shape[2], num_splits)](
            part_acc, part_ml, query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
            keys_per_split, self.qk_scale, self.window, self.soft_cap, query.stride(0), query.stride(1),
            *self.strides(),
            BLOCK_M=max(16, triton.next_power_of_2(self.group)), BLOCK_N=block_n, NUM_SPLITS=num_splits,
            **self.constexprs(), num_warps=4, num_stages=2,
        )
        _split_reduce_kernel[(num_seqs, num_q_heads)](
            out, part_acc, part_ml, self.v_scale, out.stride(0), out.stride(1),
            HEAD_DIM=query.shape[2], HEAD_PAD=self.head_pad, NUM_SPLITS=num_splits,
            num_warps=8 if num_splits * self.head_pad >= 8192 else 4,
        )

    def unified(self, max_seqlen_q: int, max_seqlen_k: int, decode_only: bool) -> None:
        """Prefill chunks and decodes in one launch over (query tile, KV head)."""
        query, out = self.query, self.out
        num_tokens, num_seqs = query.shape[0], self.seq_lens.numel()
        # Long prefill chunks get the big tiles that keep tensor cores busy; decodes fill 16 rows at most.
        # Head sizes above 128 keep 64-row tiles and two stages so K/V tiles fit in shared memory.
        big_tiles = not decode_only and max_seqlen_q >= 256 and self.head_pad <= 128
        block_m = 16 if decode_only else (128 if big_tiles else 64)
        block_m = max(block_m, triton.next_power_of_2(self.group))
        block_q = block_m // self.group
        num_q_tiles = num_tokens // block_q + num_seqs  # an upper bound; surplus programs exit at once
        ranged = self.ranges is not None
        _paged_attention_kernel[(num_q_tiles, self.key_cache.shape[2])](
            out, query, self.key_cache, self.value_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens,
            self.ranges if ranged else self.seq_lens, num_seqs, self.qk_scale, self.window, self.soft_cap,
            self.v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1), *self.strides(),
            self.ranges.stride(0) if ranged else 0, RANGED=ranged,
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=_block_n(max_seqlen_k, self.head_pad), **self.constexprs(),
            num_warps=8 if big_tiles or (self.head_pad > 128 and not decode_only) else 4,
            num_stages=3 if big_tiles else 2,
        )


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor | None = None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    num_splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    bidirectional_ranges: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.attention.paged_attention: the unified kernel, or the split-K decode kernels when every
    sequence decodes one token (num_splits: None = heuristic; tests force it). An fp8 cache reads as
    stored * k_scale / v_scale. bidirectional_ranges widen each row's visible keys (masked per row); a decode-only
    step ignores them (each query is its sequence's last token, whose range can reach no further)."""
    _check_layouts(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens)
    check_scales(key_cache, value_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1, "out must match query with unit last stride"
    num_tokens, num_seqs = query.shape[0], seq_lens.numel()
    if num_tokens == 0:
        return out
    # Soft-capping scales the dot products by scale / cap before tanh, and the tanh by cap in the log2 domain.
    # k_scale rides on the score scale: q . (k * k_scale) * scale = (q . k) * (scale * k_scale).
    scale = scale * float(k_scale)
    qk_scale = scale * _LOG2E if logits_soft_cap is None else scale / logits_soft_cap
    decode_only = max_seqlen_q == 1 and num_tokens == num_seqs
    ranges = None if decode_only else _check_ranges(bidirectional_ranges, num_tokens)
    launch = _Launch(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, qk_scale, float(v_scale),
                     max(16, triton.next_power_of_2(query.shape[2])), _dot_dtype(key_cache.dtype, query.dtype),
                     sliding_window or 0, 0.0 if logits_soft_cap is None else logits_soft_cap * _LOG2E, ranges)
    # A decode reads at most its window: split that, not the whole context.
    decode_keys = max_seqlen_k if sliding_window is None else min(max_seqlen_k, sliding_window)
    if decode_only and num_splits is None:
        num_splits = _num_decode_splits(num_seqs, key_cache.shape[2], decode_keys, query.device)
    if decode_only and num_splits > 1:
        launch.split_decode(decode_keys, triton.next_power_of_2(num_splits))
    else:
        launch.unified(max_seqlen_q, max_seqlen_k, decode_only)
    return out
