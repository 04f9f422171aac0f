"""The torch reference of the bitmask op: the oracle, and the CPU path."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """kernels.bitmask.apply_token_bitmask by unpacking the words into a bool mask."""
    vocab = logits.shape[1]
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]
    masked = logits[rows].masked_fill_(~allowed, -float("inf"))
    logits[rows] = masked
