"""The grammar token bitmask applied to logits: bit t of a row's int32 words (little-endian within a word,
as xgrammar packs them) set means token t is allowed; cleared tokens become -inf."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels.bitmask import cpu, reference
from pagedserve.kernels.dispatch import Implementations


def _load_triton() -> ModuleType:
    from pagedserve.kernels.bitmask import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def apply_token_bitmask(
    logits: torch.Tensor,  # [R, V] float, masked in place
    bitmask: torch.Tensor,  # [N, ceil(V / 32)] int32, on the logits' device
    rows: torch.Tensor,  # [N] int64: the logits row each bitmask row masks
) -> None:
    """Set logits[rows[i], t] = -inf for every token t whose bit is clear in bitmask[i]."""
    _IMPLEMENTATIONS.select(logits).apply_token_bitmask(logits, bitmask, rows)
