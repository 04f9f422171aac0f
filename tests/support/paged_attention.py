"""Paged attention test inputs (a step's flat queries over a random block pool, non-contiguous block tables) and
the slow per-sequence attention every kernel is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (q_len, seq_len): a chunked prefill over a cached prefix spanning several query tiles at GQA 4 and 8,
# decodes (one at position 0), a whole-prompt prefill and a short chunk; lengths straddle block edges.
MIXED = [(40, 70), (1, 45), (17, 17), (1, 1), (3, 64), (1, 33)]
DECODES = [(1, 200), (1, 1), (1, 37), (1, 129)]
FP32_TOL = {"atol": 2e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


@dataclass
class PagedBatch:
    """One step's attention inputs: flat queries, a random block pool and non-contiguous block tables."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    scale: float

    def args(self) -> tuple:
        """Positional arguments of paged_attention, max lengths included."""
        q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.cu_seqlens_q,
                self.seq_lens, self.scale, int(q_lens.max()), int(self.seq_lens.max()))


def make_batch(
    lens: list[tuple[int, int]],  # (q_len, seq_len) per sequence; seq_len counts this step's tokens
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """A batch whose sequences own random, scattered blocks of a pool larger than they need."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in lens]
    num_blocks = sum(blocks_per_seq) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    # A spare column: tables are wider than any sequence needs, as the runner pads them.
    block_tables = torch.zeros(len(lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[used : used + n].int()
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q_lens = torch.tensor([q for q, _ in lens])
    return PagedBatch(
        query=torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, generator=gen).to(dtype),
        key_cache=torch.randn(shape, generator=gen).to(dtype),
        value_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=block_tables,
        cu_seqlens_q=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int(),
        seq_lens=torch.tensor([k for _, k in lens], dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def per_sequence_attention(batch: PagedBatch, window: int | None = None,
                           soft_cap: float | None = None) -> torch.Tensor:  # -> [T, Hq, D] fp32
    """Slow reference: per sequence, gather K/V token by token through the block table, fp32 softmax; with
    `window`, a query sees only its last `window` keys; with `soft_cap`, scores are capped by tanh first."""
    block_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    group = batch.query.shape[1] // num_kv_heads
    out = torch.empty(batch.query.shape, dtype=torch.float32)
    for s in range(batch.seq_lens.numel()):
        start, end = int(batch.cu_seqlens_q[s]), int(batch.cu_seqlens_q[s + 1])
        seq_len = int(batch.seq_lens[s])
        slots = [(int(batch.block_tables[s, p // block_size]), p % block_size) for p in range(seq_len)]
        k = torch.stack([batch.key_cache[b, o] for b, o in slots]).float().repeat_interleave(group, dim=1)
        v = torch.stack([batch.value_cache[b, o] for b, o in slots]).float().repeat_interleave(group, dim=1)
        for i in range(end - start):
            pos = seq_len - (end - start) + i
            first = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", batch.query[start + i].float(), k[first : pos + 1]) * batch.scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            out[start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[first : pos + 1])
    return out
