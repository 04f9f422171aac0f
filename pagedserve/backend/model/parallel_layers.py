"""The tensor-parallel layers over a rank's shard (sharding.py): row-parallel projections and MoE blocks whose
partial outputs are all-reduced, a vocab-parallel embedding (all-reduced) and lm_head (logits gathered to rank 0).
The collectives are the rank's group's (`Collectives`; worker/parallel.py's TensorParallel)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from pagedserve.backend.model.moe import SparseMoeBlock
from pagedserve.backend.model.sharding import ROW_PARALLEL, load_sharded_model, vocab_shard_size


class Collectives(Protocol):
    """A rank's group as these layers use it."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks in place."""

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` on rank 0, in rank order; None on the other ranks."""


class RowParallelLinear(nn.Module):
    """A row-parallel projection or MoE block: this rank's partial product, summed over the ranks (a bias lives on
    rank 0)."""

    def __init__(self, base: nn.Module, group: Collectives):
        super().__init__()
        self.base = base
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) all-reduced."""
        out = self.base(x)
        self.group.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + Vp) of the embedding table: ids outside them look up zeros, and the sum over
    the ranks is every token's one row."""

    def __init__(self, base: nn.Embedding, group: Collectives, start: int):
        super().__init__()
        self.base = base
        self.group = group
        self.start = start

    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows (their dtype is the model's, which Gemma's scaling reads)."""
        return self.base.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """The embeddings of `input_ids`, all-reduced."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.base.num_embeddings)
        out = self.base(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        self.group.all_reduce(out)
        return out


class VocabParallelLMHead(nn.Module):
    """This rank's Vp rows of the lm_head: each rank's logits gathered to rank 0, which gets the whole vocabulary's
    (the padding cut off); the other ranks get [R, 0]. No rows: no collective on any rank (their plans agree)."""

    def __init__(self, base: nn.Module, group: Collectives, vocab_size: int):
        super().__init__()
        self.base = base
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] on rank 0, [R, 0] elsewhere
        """This rank's logits, gathered."""
        if hidden.shape[0] == 0:
            return hidden.new_zeros(0, self.vocab_size if self.group.rank == 0 else 0)
        parts = self.group.gather(self.base(hidden).contiguous())
        if parts is None:
            return hidden.new_zeros(hidden.shape[0], 0)
        return torch.cat(parts, dim=1)[:, : self.vocab_size].contiguous()


def load_parallel_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int,
                        group: Collectives) -> nn.Module:
    """This rank's shard of the model, its row-parallel projections and MoE blocks wrapped to all-reduce, its
    embedding and lm_head to join their rows over the ranks (a tied pair keeps its one shared table)."""
    model = load_sharded_model(path, dtype, device, max_position, group.rank, group.world_size)
    vocab = model.config.vocab_size
    start = group.rank * vocab_shard_size(vocab, group.world_size)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group, start)
    model.lm_head = VocabParallelLMHead(model.lm_head, group, vocab)
    wrap_row_parallel(model, group)
    return model


def wrap_row_parallel(model: nn.Module, group: Collectives) -> None:
    """Wrap each row-parallel projection to all-reduce, and each MoE block whole: its experts' and shared expert's
    partial sums are reduced once, at its output (the shared expert's gate scales each token's partial alike)."""
    in_moe = {id(m) for block in model.modules() if isinstance(block, SparseMoeBlock) for m in block.modules()}
    for module in list(model.modules()):
        if id(module) in in_moe:
            continue
        for name, child in list(module.named_children()):
            if name in ROW_PARALLEL or isinstance(child, SparseMoeBlock):
                setattr(module, name, RowParallelLinear(child, group))
