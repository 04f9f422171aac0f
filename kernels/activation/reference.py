"""The torch reference of SiLU-and-mul, as transformers' Llama MLP computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul with torch ops."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
