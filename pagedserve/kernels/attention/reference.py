"""The batched torch reference of paged attention: the oracle, and the CPU path where no native kernel serves."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels import kv8

SUPPORTS_FP8_KV = True  # the oracle reads an fp8 cache by kv8.dequantize after each gather
SUPPORTS_BIDIRECTIONAL = True  # bidirectional_ranges (Gemma 3's image runs) join each query's causal mask
_local = threading.local()
# SDPA's enable_gqa (torch >= 2.5) lets a whole fresh prompt use the causal kernel without expanding K/V.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def _token_coordinates(cu_seqlens_q: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each flat query token: its sequence index and its index inside that sequence's chunk."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seq_idx = torch.repeat_interleave(
        torch.arange(q_lens.numel(), device=q_lens.device), q_lens, output_size=num_tokens
    )
    pos_in_chunk = torch.arange(num_tokens, device=q_lens.device) - cu_seqlens_q[seq_idx].long()
    return seq_idx, pos_in_chunk


def _workspace(slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer reused across calls (per thread): a fresh multi-MB allocation page-faults on every
    layer, which costs several times the copy itself on the CPU. It only grows, to the largest step seen."""
    buffers = _local.__dict__.setdefault("buffers", {})
    # A buffer made under inference_mode cannot be written outside it (and the reverse), so each mode has its own.
    key = (slot, dtype, device, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _kv_rows(block_tables: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row ids into a cache viewed as [num_blocks * block_size * Hkv, D], ordered [S, Hkv, L]."""
    device = block_tables.device
    blocks = block_tables[:, :num_blocks].long()  # [S, nb]
    slots = (blocks[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # [S, L]
    heads = torch.arange(num_kv_heads, device=device)
    return (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    rows: torch.Tensor,  # from _kv_rows
    num_seqs: int,
    slot: str,
) -> torch.Tensor:  # -> [S, Hkv, L, D], valid until the next gather into the same slot
    """One index_select of every sequence's context, already in SDPA's heads-before-positions layout."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    stored = cache.view(torch.uint8) if kv8.is_fp8(cache) else cache  # fp8 gathered as bytes, on every device
    out = _workspace(slot, rows.numel() * head_dim, stored.dtype, cache.device).view(-1, head_dim)
    torch.index_select(stored.view(-1, head_dim), 0, rows, out=out)
    return out.view(cache.dtype).view(num_seqs, num_kv_heads, -1, head_dim)


@dataclass(frozen=True, slots=True)
class KVRead:
    """How gathered K/V become attention operands: the query's dtype, and an fp8 cache's per-tensor scales
    (stored * scale, in fp32, first: the contract's read rule)."""

    dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    def convert(self, gathered: torch.Tensor, scale: float) -> torch.Tensor:
        if kv8.is_fp8(gathered):
            return kv8.dequantize(gathered, scale).to(self.dtype)
        return gathered.to(self.dtype)


def _gather_kv_pair(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, max_seqlen_k: int,
    read: KVRead,
) -> tuple[torch.Tensor, torch.Tensor]:  # -> K, V: [S, Hkv, L, D] in read.dtype
    """Gather K and V of the first ceil(max_seqlen_k / block_size) blocks of every sequence."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = min(-(-max_seqlen_k // block_size), block_tables.shape[1])
    rows = _kv_rows(block_tables, num_blocks, block_size, num_kv_heads)
    num_seqs = block_tables.shape[0]
    k = read.convert(_gather_kv(key_cache, rows, num_seqs, "key"), read.k_scale)
    return k, read.convert(_gather_kv(value_cache, rows, num_seqs, "value"), read.v_scale)


@dataclass(frozen=True, slots=True)
class ScoreMods:
    """What changes a score before the softmax: a sliding window (a query at p sees keys in (p - window, p])
    and Gemma 2's soft-capping (cap * tanh(score / cap)); None for either means none."""

    sliding_window: int | None = None
    soft_cap: float | None = None

    def visible(self, key_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Causal (and windowed) visibility of keys at key_pos to queries at q_pos, broadcast together."""
        return self.visible_or_ranged(key_pos, q_pos)

    def visible_or_ranged(self, key_pos: torch.Tensor, q_pos: torch.Tensor, lo: torch.Tensor | None = None,
                          hi: torch.Tensor | None = None) -> torch.Tensor:
        """Visibility with each query's bidirectional range [lo, hi) (broadcast like q_pos) added to its causal
        set before the window cuts: (k <= p or lo <= k < hi) and k > p - window."""
        mask = key_pos <= q_pos
        if lo is not None:
            mask = mask | ((key_pos >= lo) & (key_pos < hi))
        if self.sliding_window is not None:
            mask &= key_pos > q_pos - self.sliding_window
        return mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        """SDPA, or its math where the scores are soft-capped (which SDPA cannot do)."""
        if self.soft_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        scores = (torch.tanh(scores / self.soft_cap) * self.soft_cap).masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1).to(q.dtype), v)


NO_MODS = ScoreMods()


def _decode_attention(
    query: torch.Tensor,  # [S, Hq, D], one query per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    seq_lens: torch.Tensor,  # [S] int64
    scale: float,
    max_seqlen_k: int,
    mods: ScoreMods = NO_MODS,
    read: KVRead | None = None,
) -> torch.Tensor:  # -> [S, Hq, D]
    """One query per sequence: no padding and no causal structure beyond the length (and window) mask."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    k, v = _gather_kv_pair(key_cache, value_cache, block_tables, max_seqlen_k,
                           read or KVRead(query.dtype))  # [S, Hkv, Lk, D]
    q = query.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    key_pos = torch.arange(k.shape[2], device=query.device)
    mask = mods.visible(key_pos[None, :], seq_lens[:, None] - 1)[:, None, None, :]  # [S, 1, 1, Lk]
    o = mods.attend(q, k, v, mask, scale)
    return o.reshape(num_seqs, num_q_heads, head_dim)


def _fresh_prompt_attention(
    query: torch.Tensor,  # [L, Hq, D], a whole prompt with nothing cached before it
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [1, max_blocks]
    scale: float,
    read: KVRead | None = None,
) -> torch.Tensor:  # -> [L, Hq, D]
    """Plain causal attention: SDPA's causal kernel needs no mask when queries and keys both start at 0."""
    length = query.shape[0]
    k, v = _gather_kv_pair(key_cache, value_cache, block_table, length, read or KVRead(query.dtype))
    k, v = k[:, :, :length], v[:, :, :length]  # [1, Hkv, L, D]
    q = query.transpose(0, 1)[None]  # [1, Hq, L, D]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _chunk_attention(
    query: torch.Tensor,  # [T, Hq, D], the chunks of these sequences back to back
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    cu_seqlens_q: torch.Tensor,  # [S + 1] int64
    seq_lens: torch.Tensor,  # [S] int64
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mods: ScoreMods = NO_MODS,
    read: KVRead | None = None,
    ranges: torch.Tensor | None = None,  # [T, 2]: each token's bidirectional [lo, hi)
) -> torch.Tensor:  # -> [T, Hq, D]
    """Causal attention of query chunks padded to max_seqlen_q, over their gathered context (plus each token's
    bidirectional range)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.numel()
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k, v = _gather_kv_pair(key_cache, value_cache, block_tables, max_seqlen_k,
                           read or KVRead(query.dtype))  # [S, Hkv, Lk, D]
    seq_idx, pos_in_chunk = _token_coordinates(cu_seqlens_q, num_tokens)
    q_pad = query.new_zeros(num_seqs, max_seqlen_q, num_q_heads, head_dim)
    q_pad[seq_idx, pos_in_chunk] = query
    # Rows ordered (query position, group member) so one mask row serves the whole GQA group.
    q = (
        q_pad.view(num_seqs, max_seqlen_q, num_kv_heads, group, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(num_seqs, num_kv_heads, max_seqlen_q * group, head_dim)
    )
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    chunk = torch.arange(max_seqlen_q, device=query.device)
    key_pos = torch.arange(k.shape[2], device=query.device)
    # Padded query rows sit at the last position, so no row is fully masked (no NaN); they are dropped below.
    q_pos = torch.minimum((seq_lens - q_lens)[:, None] + chunk[None, :], seq_lens[:, None] - 1)  # [S, Lq]
    lo = hi = None
    if ranges is not None:  # padded rows keep the empty range [0, 0)
        lo, hi = q_pad.new_zeros((2, num_seqs, max_seqlen_q), dtype=torch.long).unbind(0)
        lo[seq_idx, pos_in_chunk] = ranges[:, 0].long()
        hi[seq_idx, pos_in_chunk] = torch.minimum(ranges[:, 1].long(), seq_lens[seq_idx])
        lo, hi = lo[:, :, None], hi[:, :, None]
    mask = mods.visible_or_ranged(key_pos[None, None, :], q_pos[:, :, None], lo, hi)  # [S, Lq, Lk]
    mask = mask[:, None, :, None, :].expand(-1, 1, -1, group, -1)
    mask = mask.reshape(num_seqs, 1, max_seqlen_q * group, k.shape[2])
    o = mods.attend(q, k, v, mask, scale)
    o = o.view(num_seqs, num_kv_heads, max_seqlen_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return o[seq_idx, pos_in_chunk].reshape(num_tokens, num_q_heads, head_dim)


def _mixed_attention(
    query: torch.Tensor,  # [T, Hq, D], decodes and prefill chunks interleaved
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S + 1] int64
    seq_lens: torch.Tensor,  # [S] int64
    scale: float,
    max_seqlen_q: int,
    q_lens: torch.Tensor,  # [S] int64
    is_decode: torch.Tensor,  # [S] bool, q_lens == 1
    mods: ScoreMods = NO_MODS,
    read: KVRead | None = None,
    ranges: torch.Tensor | None = None,  # [T, 2]
) -> torch.Tensor:  # -> [T, Hq, D]
    """Decodes and prefill chunks in two batches (one K/V gather each): decodes are not padded to a chunk (a
    sequence's last query sees its whole context, so a bidirectional range adds nothing to a decode)."""
    num_tokens = query.shape[0]
    result = torch.empty_like(query)
    dec = is_decode.nonzero().squeeze(1)
    dec_tokens = cu_seqlens_q[dec]
    result[dec_tokens] = _decode_attention(
        query[dec_tokens], key_cache, value_cache, block_tables[dec], seq_lens[dec], scale,
        int(seq_lens[dec].max()), mods, read,
    )
    pre = (~is_decode).nonzero().squeeze(1)
    pre_token_mask = ~is_decode.repeat_interleave(q_lens, output_size=num_tokens)
    pre_cu = torch.nn.functional.pad(q_lens[pre].cumsum(0), (1, 0))
    result[pre_token_mask] = _chunk_attention(
        query[pre_token_mask], key_cache, value_cache, block_tables[pre], pre_cu, seq_lens[pre],
        scale, max_seqlen_q, int(seq_lens[pre].max()), mods, read,
        None if ranges is None else ranges[pre_token_mask],
    )
    return result


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_seqlen_q: int, max_seqlen_k: int, out: torch.Tensor | None = None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    bidirectional_ranges: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.attention.paged_attention batched over all sequences in torch (layouts there); an fp8 cache is
    dequantized (stored * k_scale / v_scale) after each gather."""
    num_tokens, num_seqs = query.shape[0], seq_lens.numel()
    seq_lens = seq_lens.long()
    cu_seqlens_q = cu_seqlens_q.long()
    mods = ScoreMods(sliding_window, logits_soft_cap)
    read = KVRead(query.dtype, k_scale, v_scale)
    if max_seqlen_q == 1 and num_tokens == num_seqs:
        result = _decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seqlen_k,
                                   mods, read)
    else:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        is_decode = q_lens == 1
        num_decodes = int(is_decode.sum())
        plain = mods == NO_MODS and bidirectional_ranges is None
        if num_seqs == 1 and int(seq_lens[0]) == num_tokens and _SDPA_HAS_GQA and plain:
            result = _fresh_prompt_attention(query, key_cache, value_cache, block_tables, scale, read)
        elif num_decodes in (0, num_seqs):
            result = _chunk_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                      scale, max_seqlen_q, max_seqlen_k, mods, read, bidirectional_ranges)
        else:
            result = _mixed_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                      max_seqlen_q, q_lens, is_decode, mods, read, bidirectional_ranges)
    if out is None:
        return result
    out.copy_(result)
    return out
