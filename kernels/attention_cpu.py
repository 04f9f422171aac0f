"""The engine's CPU attention: decodes through the native in-place kernel, prefill chunks one sequence at a time.

The batched torch reference pads every prefill chunk of a step to the longest one and every context to the
longest context, so a 2,048-token step of 38 prompts spent more time in padded attention than in its GEMMs.
Here each prefill chunk runs SDPA over its own context only (causal without a mask for a fresh prompt), and
decodes read the cache in place (`cpu_native`). Without the native kernel, decodes use the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_native, reference


def _context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:  # -> [Hkv, length, D]
    """One sequence's first `length` cached tokens, gathered block by block (whole blocks, few copies)."""
    block_size = cache.shape[1]
    blocks = table[: -(-length // block_size)].long()
    rows = cache.index_select(0, blocks).flatten(0, 1)[:length]  # [length, Hkv, D]
    return rows.transpose(0, 1)


def _prefill_chunk(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # -> [q_len, Hq, D]
    """Causal attention of one chunk whose last query sits at seq_len - 1."""
    q_len, num_q_heads = query.shape[0], query.shape[1]
    group = num_q_heads // key_cache.shape[2]
    # K/V repeated per query head: SDPA's enable_gqa takes the slow math path on the CPU, while 4-D
    # inputs of equal head counts reach the flash kernel (1.5-2x faster at prompt lengths 50-200).
    k = _context(key_cache, table, seq_len).to(query.dtype).repeat_interleave(group, 0)[None]
    v = _context(value_cache, table, seq_len).to(query.dtype).repeat_interleave(group, 0)[None]
    q = query.transpose(0, 1)[None]  # [1, Hq, q_len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Query i sits at seq_len - q_len + i and sees keys up to there.
        key_pos = torch.arange(seq_len)
        mask = key_pos[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's tokens
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged K/V (same contract as the reference)."""
    if not cpu_native.supports(query, key_cache):
        return reference.paged_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                         scale, max_seqlen_q, max_seqlen_k, out)
    num_tokens, num_seqs = query.shape[0], seq_lens.numel()
    if max_seqlen_q == 1 and num_tokens == num_seqs:
        return cpu_native.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out)
    result = out if out is not None else torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lengths = seq_lens.tolist()
    decodes = [s for s in range(num_seqs) if starts[s + 1] - starts[s] == 1]
    if decodes:
        rows = torch.tensor([starts[s] for s in decodes])
        index = torch.tensor(decodes)
        result[rows] = cpu_native.decode_attention(query[rows], key_cache, value_cache, block_tables[index],
                                                   seq_lens[index], scale)
    for s in range(num_seqs):
        begin, end = starts[s], starts[s + 1]
        if end - begin > 1:
            result[begin:end] = _prefill_chunk(query[begin:end], key_cache, value_cache, block_tables[s],
                                               lengths[s], scale)
    return result
