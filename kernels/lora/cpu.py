"""The multi-LoRA shrink and expand on the CPU: one matmul per adapter present over its rows (a slice when
they are contiguous), never a per-row gather of the adapter weights; base-model rows are not touched."""

from __future__ import annotations

import torch
from pagedserve.kernels.lora.grouping import SlotGroups, group_slots


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                groups: SlotGroups | None = None) -> torch.Tensor:
    """kernels.lora.lora_shrink: y[rows] = x[rows] @ A[slot].T per slot present, zeros elsewhere."""
    groups = groups or group_slots(slots)
    y = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in groups.groups:
        if isinstance(rows, slice):
            torch.matmul(x[rows], lora_a[slot].T, out=y[rows])
        else:
            y.index_copy_(0, rows, x[rows] @ lora_a[slot].T)
    return y


def lora_expand_add(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                    offset: int = 0, groups: SlotGroups | None = None) -> None:
    """kernels.lora.lora_expand_add: out[rows, offset:offset + N] += y[rows] @ B[slot].T per slot present."""
    groups = groups or group_slots(slots)
    view = out[:, offset:offset + lora_b.shape[1]]
    for slot, rows in groups.groups:
        if isinstance(rows, slice):
            view[rows].addmm_(y[rows], lora_b[slot].T)
        else:
            view.index_put_((rows,), torch.addmm(view[rows], y[rows], lora_b[slot].T))
