"""The rows of each adapter slot in a batch, found once per step and shared by every LoRA layer's calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SlotGroups:
    """Rows sorted by slot, and on the CPU the (slot, rows) of each slot present, base-model rows left out.

    `rows` is a slice where the slot's rows are contiguous (no gather), else an index tensor.
    """

    slots: torch.Tensor  # [T] the slots the groups were made from
    order: torch.Tensor  # [T] int64 row indices, stable-sorted by slot (-1 first)
    groups: tuple[tuple[int, slice | torch.Tensor], ...] | None  # None on devices: the kernels read `order`


def group_slots(slots: torch.Tensor) -> SlotGroups:
    """Group a batch's rows by slot: one sort; on the CPU one host read of the distinct slots and counts."""
    assert slots.dim() == 1 and not slots.dtype.is_floating_point, "slots must be a [T] integer tensor"
    sorted_slots, order = torch.sort(slots.long(), stable=True)
    if slots.device.type != "cpu":
        return SlotGroups(slots, order, None)
    ids, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    groups, start = [], 0
    for slot, count in zip(ids.tolist(), counts.tolist(), strict=True):
        if slot >= 0:
            groups.append((slot, _rows(order[start:start + count])))
        start += count
    return SlotGroups(slots, order, tuple(groups))


def _rows(index: torch.Tensor) -> slice | torch.Tensor:
    """A slice when the (ascending) rows are one contiguous range, else the index itself."""
    first, last = int(index[0]), int(index[-1])
    return slice(first, last + 1) if last - first + 1 == index.numel() else index
