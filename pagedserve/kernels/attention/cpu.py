"""The engine's CPU attention: decodes read the cache in place (native kernel), prefill chunks one at a time.

The batched reference pads every prefill chunk of a step to the longest one and every context to the
longest context; here each chunk runs SDPA over its own context only (causal without a mask for a fresh
prompt), and decodes run `paged_attention.cpp`. Without the native library, decodes use the reference.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pagedserve.kernels import kv8, native
from pagedserve.kernels.attention import cpu_prefill, reference
from pagedserve.kernels.attention.reference import NO_MODS, ScoreMods
from pagedserve.kernels.native.fp8 import cache_dtype_code
from pagedserve.kernels.native.split import openmp_available

_decode_kernel = native.Function(
    "pagedserve_decode_attention",
    [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8
    + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    + [ctypes.c_int, ctypes.c_float, ctypes.c_float],
)
# An fp8 cache (kernels.kv8) is read in place by the native kernels (dequantized in registers), or dequantized
# after the gather on the SDPA path.
SUPPORTS_FP8_KV = True
# A chunk with bidirectional ranges (Gemma 3's image runs) is cut into its causal rows (the usual paths) and each
# run's rows (SDPA up to the run's end); the step's other sequences keep the native kernels.
SUPPORTS_BIDIRECTIONAL = True
# Tests set this to run the decode kernel's portable loops where the CPU has AVX-512 (the path AVX2 CPUs take).
PORTABLE_DECODE = False


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when decode_attention can serve these tensors (CPU, fp32/bf16 query, contiguous caches of its dtype
    or fp8)."""
    return (
        native.dtype_code(query) is not None
        and cache_dtype_code(key_cache, query) is not None
        and key_cache.is_contiguous()
        and native.load() is not None
    )


def decode_attention(
    query: torch.Tensor,  # [S, Hq, D], one query token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S], context length including the query token
    scale: float,
    out: torch.Tensor | None = None,  # [S, Hq, D]
    mods: ScoreMods = NO_MODS,
    k_scale: float = 1.0,  # an fp8 cache reads as stored * k_scale / v_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's single query over its paged context, read in place; call supports() first."""
    if native.load() is None:
        raise RuntimeError("the native CPU attention kernel is not available")
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    query = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    target = out
    if out is None or out.stride(2) != 1 or out.stride(1) != head_dim:
        out = torch.empty(query.shape, dtype=query.dtype)
    if num_seqs == 0:
        return out if target is None else target
    window, soft_cap = mods.sliding_window or 0, mods.soft_cap or 0.0
    # The kernel shares the keys among torch's OpenMP threads itself (whole sequences, or a long sequence's
    # context cut into parts merged by log-sum-exp where there are fewer sequences than threads).
    max_parts = torch.get_num_threads() if openmp_available() else 1
    _decode_kernel(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, tables.stride(0),
        query.stride(0), out.stride(0), scale, window, soft_cap, native.dtype_code(query), max_parts,
        int(PORTABLE_DECODE), cache_dtype_code(key_cache, query), k_scale, v_scale,
    )
    if target is not None and target is not out:
        target.copy_(out)
        return target
    return out


def _context(cache: torch.Tensor, table: torch.Tensor, begin: int, end: int, dtype: torch.dtype,
             scale: float = 1.0) -> torch.Tensor:  # -> [Hkv, L, D]
    """One sequence's cached tokens begin..end-1 in `dtype`, gathered block by block (whole blocks, few copies);
    an fp8 cache is gathered as bytes and read as stored * scale (kernels.kv8)."""
    block_size = cache.shape[1]
    first = begin // block_size
    blocks = table[first : -(-end // block_size)].long()
    stored = cache.view(torch.uint8) if kv8.is_fp8(cache) else cache
    rows = stored.index_select(0, blocks).flatten(0, 1)[begin - first * block_size : end - first * block_size]
    if stored is not cache:
        return kv8.dequantize(rows.view(cache.dtype), scale).to(dtype).transpose(0, 1)
    return rows.transpose(0, 1).to(dtype)


def _prefill_chunk(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
    mods: ScoreMods = NO_MODS,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's k_scale, v_scale
) -> torch.Tensor:  # -> [q_len, Hq, D]
    """Causal attention of one chunk whose last query sits at seq_len - 1, over the keys its window reaches."""
    if cpu_prefill.preferred(query, key_cache):  # the native kernel over the block table (bf16 on AMX)
        return cpu_prefill.prefill_attention(query, key_cache, value_cache, table, seq_len, scale, mods,
                                             kv_scales=kv_scales)
    q_len, num_q_heads = query.shape[0], query.shape[1]
    group = num_q_heads // key_cache.shape[2]
    window = mods.sliding_window
    begin = 0 if window is None else max(0, seq_len - q_len - window + 1)
    # K/V repeated per query head: on the CPU SDPA's enable_gqa takes the slow math path, while 4-D
    # inputs of equal head counts reach the flash kernel (docs/benchmarks.md, offline throughput).
    if q_len < seq_len and mods == NO_MODS and _flash_with_lse is not None:
        return _chunk_after_prefix(query, key_cache, value_cache, table, seq_len, scale, kv_scales)
    k = _context(key_cache, table, begin, seq_len, query.dtype, kv_scales[0]).repeat_interleave(group, 0)[None]
    v = _context(value_cache, table, begin, seq_len, query.dtype, kv_scales[1]).repeat_interleave(group, 0)[None]
    q = query.transpose(0, 1)[None]  # [1, Hq, q_len, D]
    if q_len == seq_len and mods == NO_MODS:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Query i sits at seq_len - q_len + i and sees keys up to there (within its window).
        key_pos = torch.arange(begin, seq_len)
        mask = mods.visible(key_pos[None, :], (seq_len - q_len + torch.arange(q_len))[:, None])
        o = mods.attend(q, k, v, mask, scale)
    return o[0].transpose(0, 1)


# SDPA's CPU flash kernel, returning the log-sum-exp of each query's scores beside its output (private op).
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _chunk_after_prefix(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:  # -> [q_len, Hq, D]
    """A chunk after a cached prefix as two flash passes merged by their log-sum-exps.

    Against the prefix every query sees every key, so the queries of each KV head's group are stacked into one
    unmasked pass (no repeated K/V, no mask); the chunk against itself is causal with equal lengths. A mask
    over the whole context would send SDPA down a slower masked path over K/V repeated per query head.
    """
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group, prefix = num_q_heads // num_kv_heads, seq_len - q_len
    q = query.transpose(0, 1)  # [Hq, q_len, D]; heads h*group..h*group+group-1 read KV head h
    k_scale, v_scale = kv_scales
    k_old = _context(key_cache, table, 0, prefix, query.dtype, k_scale)[None]
    v_old = _context(value_cache, table, 0, prefix, query.dtype, v_scale)[None]
    out_old, lse_old = _flash_with_lse(q.reshape(1, num_kv_heads, group * q_len, head_dim), k_old, v_old,
                                       scale=scale)[:2]
    k_new = _context(key_cache, table, prefix, seq_len, query.dtype, k_scale).repeat_interleave(group, 0)[None]
    v_new = _context(value_cache, table, prefix, seq_len, query.dtype, v_scale).repeat_interleave(group, 0)[None]
    out_new, lse_new = _flash_with_lse(q[None], k_new, v_new, is_causal=True, scale=scale)[:2]
    lse_old = lse_old.reshape(num_q_heads, q_len, 1)
    lse_new = lse_new.reshape(num_q_heads, q_len, 1)
    total = torch.logaddexp(lse_old, lse_new)
    merged = (out_old.reshape(num_q_heads, q_len, head_dim).float() * torch.exp(lse_old - total)
              + out_new.reshape(num_q_heads, q_len, head_dim).float() * torch.exp(lse_new - total))
    return merged.to(query.dtype).transpose(0, 1)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor | None = None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, bidirectional_ranges: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.attention.paged_attention on the CPU: native decodes, per-sequence prefill chunks (an fp8 cache
    read as stored * k_scale / v_scale; a chunk whose bidirectional ranges reach past its queries, masked SDPA)."""
    if not supports(query, key_cache):
        return reference.paged_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                         scale, max_seqlen_q, max_seqlen_k, out, sliding_window, logits_soft_cap,
                                         k_scale=k_scale, v_scale=v_scale, bidirectional_ranges=bidirectional_ranges)
    mods = ScoreMods(sliding_window, logits_soft_cap)
    num_tokens, num_seqs = query.shape[0], seq_lens.numel()
    if max_seqlen_q == 1 and num_tokens == num_seqs:
        return decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out, mods, k_scale,
                                v_scale)
    result = out if out is not None else torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lengths = seq_lens.tolist()
    decodes = [s for s in range(num_seqs) if starts[s + 1] - starts[s] == 1]
    ranged = _ranged_sequences(bidirectional_ranges, cu_seqlens_q, seq_lens)
    if decodes:
        rows = torch.tensor([starts[s] for s in decodes])
        index = torch.tensor(decodes)
        result[rows] = decode_attention(query[rows], key_cache, value_cache, block_tables[index], seq_lens[index],
                                        scale, mods=mods, k_scale=k_scale, v_scale=v_scale)
    for s in range(num_seqs):
        begin, end = starts[s], starts[s + 1]
        if s in ranged:
            result[begin:end] = _ranged_chunk(query[begin:end], key_cache, value_cache, block_tables[s], lengths[s],
                                              scale, mods, (k_scale, v_scale), bidirectional_ranges[begin:end])
        elif end - begin > 1:
            result[begin:end] = _prefill_chunk(query[begin:end], key_cache, value_cache, block_tables[s],
                                               lengths[s], scale, mods, (k_scale, v_scale))
    return result


def _ranged_sequences(ranges: torch.Tensor | None, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> set[int]:
    """The sequences with a query whose range reaches a key after it (hi > pos + 1): only those need a mask; a
    range behind its query, or a decode's (its sequence's last token), adds nothing to the causal set."""
    if ranges is None:
        return set()
    cu = cu_seqlens_q.long()
    seq_idx, pos_in_chunk = reference._token_coordinates(cu, ranges.shape[0])
    pos = (seq_lens.long() - (cu[1:] - cu[:-1]))[seq_idx] + pos_in_chunk
    return set(seq_idx[ranges[:, 1].long() > pos + 1].tolist())


def _segments(ranges: list[list[int]], first_pos: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """A ranged chunk's rows cut into runs of equal need: (begin, end, (lo, hi)) for rows whose range reaches a key
    after them, (begin, end, None) for causal rows (a run's last token among them: its range reaches no further)."""
    segments: list[tuple[int, int, tuple[int, int] | None]] = []
    for i, (lo, hi) in enumerate(ranges):
        need = (lo, hi) if hi > first_pos + i + 1 else None
        if segments and segments[-1][2] == need:
            segments[-1] = (segments[-1][0], i + 1, need)
        else:
            segments.append((i, i + 1, need))
    return segments


def _ranged_chunk(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
    mods: ScoreMods,
    kv_scales: tuple[float, float],
    ranges: torch.Tensor,  # [q_len, 2]
) -> torch.Tensor:  # -> [q_len, Hq, D]
    """A chunk with bidirectional ranges: causal rows as a chunk ending at their last position (native or flash),
    each run's rows by _run_rows."""
    first_pos = seq_len - query.shape[0]
    out = torch.empty_like(query)
    for begin, end, need in _segments(ranges.tolist(), first_pos):
        if need is None:
            out[begin:end] = _prefill_chunk(query[begin:end], key_cache, value_cache, table, first_pos + end, scale,
                                            mods, kv_scales)
        else:
            out[begin:end] = _run_rows(query[begin:end], key_cache, value_cache, table, first_pos + begin, need,
                                       scale, mods, kv_scales)
    return out


def _run_rows(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
              first_pos: int, run: tuple[int, int], scale: float, mods: ScoreMods,
              kv_scales: tuple[float, float]) -> torch.Tensor:  # query [n, Hq, D] at first_pos.. -> [n, Hq, D]
    """Rows of one range [lo, hi) that reaches past them. Where every row sees all keys before hi (the range meets
    the causal keys, no window reaches back past key 0): the native kernel where it is preferred and its KV-head
    work items keep the threads busy, else one unmasked SDPA with each KV head's query group stacked (no repeated
    K/V; not with a soft cap); otherwise masked SDPA over the keys the window reaches."""
    n, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group, (lo, hi), window = num_q_heads // num_kv_heads, run, mods.sliding_window
    last_begin = 0 if window is None else first_pos + n - window  # the last row's window start
    sees_all = lo <= first_pos + 1 and last_begin <= 0
    if sees_all and torch.get_num_threads() <= 2 * num_kv_heads and cpu_prefill.preferred(query, key_cache):
        return _native_run(query, key_cache, value_cache, table, hi, scale, mods.soft_cap, kv_scales)
    begin = 0 if window is None else max(0, first_pos - window + 1)
    k = _context(key_cache, table, begin, hi, query.dtype, kv_scales[0])  # [Hkv, L, D]
    v = _context(value_cache, table, begin, hi, query.dtype, kv_scales[1])
    q = query.transpose(0, 1)  # [Hq, n, D]
    if sees_all and mods.soft_cap is None:
        o = F.scaled_dot_product_attention(q.reshape(1, num_kv_heads, group * n, head_dim), k[None], v[None],
                                           scale=scale)
        return o.reshape(num_q_heads, n, head_dim).transpose(0, 1)
    key_pos = torch.arange(begin, hi)
    q_pos = (first_pos + torch.arange(n))[:, None]
    mask = mods.visible_or_ranged(key_pos[None, :], q_pos, torch.tensor(lo), torch.tensor(hi))
    o = mods.attend(q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None], mask, scale)
    return o[0].transpose(0, 1)


def _native_run(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                hi: int, scale: float, soft_cap: float | None,
                kv_scales: tuple[float, float]) -> torch.Tensor:  # query [n, Hq, D] -> [n, Hq, D]
    """Rows that all see keys [0, hi), as one query at hi - 1 whose KV heads' groups hold every row: the native
    prefill kernel stacks a group's rows, so each K/V tile is read once for all of them (one work item a KV head)."""
    n, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    stacked = query.reshape(n, num_kv_heads, group, head_dim).transpose(0, 1).reshape(1, -1, head_dim)
    out = cpu_prefill.prefill_attention(stacked, key_cache, value_cache, table, hi, scale, ScoreMods(None, soft_cap),
                                        kv_scales=kv_scales)
    return out.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_q_heads, head_dim)
