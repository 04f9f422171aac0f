"""Multi-LoRA deltas in the punica shape: shrink (x @ A.T into rank R) then expand (y @ B.T added to the base
layer's output), every token row with its own adapter slot, -1 meaning the base model and no work.

A caller making many calls over one batch (every LoRA layer of a step) groups its rows once with
`group_slots(slots)` and passes the groups to each call; without them each call groups for itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.lora import cpu, reference
from pagedserve.kernels.lora.grouping import SlotGroups, group_slots


def _load_triton() -> ModuleType:
    from pagedserve.kernels.lora import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def _check(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, groups: SlotGroups | None,
           x_name: str, w_name: str) -> None:
    assert x.dim() == 2 and weights.dim() == 3, f"{x_name} must be [T, *] and {w_name} [S, *, *]"
    assert slots.dim() == 1 and slots.shape[0] == x.shape[0], f"slots must be [T] for {x_name} [T, *]"
    assert not slots.dtype.is_floating_point, "slots must be an integer tensor"
    assert groups is None or groups.slots is slots, "groups must be group_slots(slots) of these slots"


def lora_shrink(
    x: torch.Tensor,  # [T, K] activations
    lora_a: torch.Tensor,  # [S, R, K] stacked A of the resident slots, rank zero-padded to R
    slots: torch.Tensor,  # [T] int: slot per row, -1 = base model
    groups: SlotGroups | None = None,  # group_slots(slots), shared by the calls of one step
) -> torch.Tensor:
    """[T, R] in x's dtype: x[t] @ lora_a[slots[t]].T, zero rows where slots[t] == -1."""
    _check(x, lora_a, slots, groups, "x", "lora_a")
    assert lora_a.shape[2] == x.shape[1], f"lora_a is [S, R, {lora_a.shape[2]}] but x has K = {x.shape[1]}"
    return _IMPLEMENTATIONS.select(x).lora_shrink(x, lora_a, slots, groups)


def lora_expand_add(
    out: torch.Tensor,  # [T, N_total] the base layer's output, added to in place
    y: torch.Tensor,  # [T, R] from lora_shrink
    lora_b: torch.Tensor,  # [S, N, R] stacked B, the adapter's scaling folded in
    slots: torch.Tensor,  # [T] int: slot per row, -1 = base model
    offset: int = 0,  # first column of out this B writes (a fused projection's slice)
    groups: SlotGroups | None = None,  # group_slots(slots), shared by the calls of one step
) -> None:
    """out[t, offset:offset + N] += y[t] @ lora_b[slots[t]].T for rows with slots[t] >= 0; others untouched."""
    _check(y, lora_b, slots, groups, "y", "lora_b")
    assert lora_b.shape[2] == y.shape[1], f"lora_b is [S, N, {lora_b.shape[2]}] but y has R = {y.shape[1]}"
    assert out.dim() == 2 and out.shape[0] == y.shape[0], "out must be [T, N_total] with y's rows"
    assert 0 <= offset and offset + lora_b.shape[1] <= out.shape[1], (
        f"offset {offset} + N {lora_b.shape[1]} exceeds out's {out.shape[1]} columns")
    _IMPLEMENTATIONS.select(out).lora_expand_add(out, y, lora_b, slots, offset, groups)


def lora_shrink_expand_add(
    out: torch.Tensor,  # [T, N_total] the base layer's output, added to in place
    x: torch.Tensor,  # [T, K] activations
    lora_a: torch.Tensor,  # [S, P * R, K] the P parts' A stacked
    lora_b: Sequence[torch.Tensor],  # per part [S, N_p, R]
    slots: torch.Tensor,  # [T] int: slot per row, -1 = base model
    offsets: Sequence[int],  # each part's first column of out
    groups: SlotGroups | None = None,  # group_slots(slots), shared by the calls of one step
) -> None:
    """A whole (fused) projection's delta: y = lora_shrink(x, lora_a), then per part p out[:, offsets[p]:][:N_p]
    += y[:, p * R:(p + 1) * R] @ lora_b[p][slot].T; one native call on the CPU where it serves the tensors."""
    assert len(lora_b) == len(offsets) and lora_a.shape[1] == len(lora_b) * lora_b[0].shape[2], (
        "lora_a must stack one rank-R A per part of lora_b")
    module = _IMPLEMENTATIONS.select(out)
    fused = getattr(module, "lora_shrink_expand_add", None)
    if fused is not None and fused(out, x, lora_a, lora_b, slots, offsets):
        return
    y = lora_shrink(x, lora_a, slots, groups)
    rank = lora_b[0].shape[2]
    for i, (b, offset) in enumerate(zip(lora_b, offsets, strict=True)):
        lora_expand_add(out, y[:, i * rank:(i + 1) * rank], b, slots, offset, groups)


def native_projection(lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                      offsets: Sequence[int]) -> cpu.NativeProjection | None:
    """For a wrapper holding these weights for good: a prepared `(out, x, slots) -> served` doing
    lora_shrink_expand_add in one native call on the CPU (False where the step's rows do not qualify, or the
    kernels are forced to torch or Triton), or None where the native kernel cannot serve the weights."""
    return cpu.NativeProjection.of(lora_a, lora_b, offsets) if lora_a.device.type == "cpu" else None


__all__ = ["SlotGroups", "native_projection", "group_slots", "lora_expand_add", "lora_shrink", "lora_shrink_expand_add"]
