"""The (token, expert) pairs of a batch sorted by expert, each expert's run padded to the GEMM's row block, and
the expert of every block: the layout the Triton MoE GEMMs walk. Torch ops only, with no host sync, so the grid
(an upper bound on the blocks) is known before the ids are read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockAlignment:
    """`sorted_ids[i]` is a flat pair index t * top_k + j (or `num_pairs` for padding), grouped by expert with
    each group padded to a multiple of `block_m`; `block_expert[b]` is the expert of rows b*block_m.., -1 past
    the last group."""

    sorted_ids: torch.Tensor  # [num_blocks * block_m] int64
    block_expert: torch.Tensor  # [num_blocks] int64
    num_pairs: int
    block_m: int


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort the pairs by expert (stable) and pad each expert's run to `block_m` rows."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount reads its maximum back to the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    dest = padded_start[sorted_expert] + torch.arange(num_pairs, device=flat.device) - start[sorted_expert]
    # At most min(E, pairs) experts have rows, each padding fewer than block_m rows.
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1) + block_m - 1) // block_m
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.long, device=flat.device)
    sorted_ids[dest] = order
    block_start = torch.arange(0, num_blocks * block_m, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1)
    return BlockAlignment(sorted_ids, block_expert, num_pairs, block_m)
