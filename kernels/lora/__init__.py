"""Multi-LoRA deltas in the punica shape: shrink (x @ A.T into rank R) then expand (y @ B.T added to the base
layer's output), every token row with its own adapter slot, -1 meaning the base model and no work."""

from __future__ import annotations

import torch
from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.lora import reference

_IMPLEMENTATIONS = Implementations(reference)


def _check(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, x_name: str, w_name: str) -> None:
    assert x.dim() == 2 and weights.dim() == 3, f"{x_name} must be [T, *] and {w_name} [S, *, *]"
    assert slots.dim() == 1 and slots.shape[0] == x.shape[0], f"slots must be [T] for {x_name} [T, *]"
    assert not slots.dtype.is_floating_point, "slots must be an integer tensor"


def lora_shrink(
    x: torch.Tensor,  # [T, K] activations
    lora_a: torch.Tensor,  # [S, R, K] stacked A of the resident slots, rank zero-padded to R
    slots: torch.Tensor,  # [T] int: slot per row, -1 = base model
) -> torch.Tensor:
    """[T, R] in x's dtype: x[t] @ lora_a[slots[t]].T, zero rows where slots[t] == -1."""
    _check(x, lora_a, slots, "x", "lora_a")
    assert lora_a.shape[2] == x.shape[1], f"lora_a is [S, R, {lora_a.shape[2]}] but x has K = {x.shape[1]}"
    return _IMPLEMENTATIONS.select(x).lora_shrink(x, lora_a, slots)


def lora_expand_add(
    out: torch.Tensor,  # [T, N_total] the base layer's output, added to in place
    y: torch.Tensor,  # [T, R] from lora_shrink
    lora_b: torch.Tensor,  # [S, N, R] stacked B, the adapter's scaling folded in
    slots: torch.Tensor,  # [T] int: slot per row, -1 = base model
    offset: int = 0,  # first column of out this B writes (a fused projection's slice)
) -> None:
    """out[t, offset:offset + N] += y[t] @ lora_b[slots[t]].T for rows with slots[t] >= 0; others untouched."""
    _check(y, lora_b, slots, "y", "lora_b")
    assert lora_b.shape[2] == y.shape[1], f"lora_b is [S, N, {lora_b.shape[2]}] but y has R = {y.shape[1]}"
    assert out.dim() == 2 and out.shape[0] == y.shape[0], "out must be [T, N_total] with y's rows"
    assert 0 <= offset and offset + lora_b.shape[1] <= out.shape[1], (
        f"offset {offset} + N {lora_b.shape[1]} exceeds out's {out.shape[1]} columns")
    _IMPLEMENTATIONS.select(out).lora_expand_add(out, y, lora_b, slots, offset)


__all__ = ["lora_expand_add", "lora_shrink"]
