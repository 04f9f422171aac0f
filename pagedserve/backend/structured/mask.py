"""Applying a step's grammar bitmask: a host bitmask of the grammar rows, applied on the logits' device."""

from __future__ import annotations

import torch

from pagedserve.kernels.bitmask import apply_token_bitmask


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask logits[rows[i]] in place to bitmask[i] (int32 words on the host): one copy to the device per
    step, whatever the number of rows."""
    device = logits.device
    with torch.inference_mode():  # the runner's logits are inference tensors
        apply_token_bitmask(logits, bitmask.to(device, non_blocking=True),
                            torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True))
