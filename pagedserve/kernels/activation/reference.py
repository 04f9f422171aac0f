"""The torch references of SiLU-and-mul and GELU(tanh)-and-mul, as transformers' Llama and Gemma MLPs compute them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul with torch ops."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.gelu_tanh_and_mul with torch ops (transformers' gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
