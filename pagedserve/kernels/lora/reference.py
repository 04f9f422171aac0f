"""The torch reference of the multi-LoRA shrink and expand: a per-row gather of each row's adapter, the oracle."""

from __future__ import annotations

import torch

from pagedserve.kernels.lora.grouping import SlotGroups


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                groups: SlotGroups | None = None) -> torch.Tensor:
    """kernels.lora.lora_shrink by gathering every row's A and one batched matvec, fp32 sums; reads only
    `slots`, never `groups`."""
    active = slots >= 0
    a = lora_a[slots.clamp(min=0).long()].float()  # [T, R, K]
    y = torch.bmm(a, x.float().unsqueeze(-1)).squeeze(-1)  # [T, R]
    return y.masked_fill_(~active[:, None], 0.0).to(x.dtype)


def lora_expand_add(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                    offset: int = 0, groups: SlotGroups | None = None) -> None:
    """kernels.lora.lora_expand_add by gathering every active row's B, fp32 sums added to out's slice; reads
    only `slots`, never `groups`."""
    rows = torch.nonzero(slots >= 0).squeeze(-1)
    n = lora_b.shape[1]
    b = lora_b[slots[rows].long()].float()  # [A, N, R]
    delta = torch.bmm(b, y[rows].float().unsqueeze(-1)).squeeze(-1)  # [A, N]
    view = out[:, offset:offset + n]
    view[rows] = (view[rows].float() + delta).to(out.dtype)
