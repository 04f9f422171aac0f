"""The torch reference of the quantized linear: dequantize in fp32, cast to the activations' dtype, F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.quant_linear.layout import QuantizedWeight


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias with W = weight.dequantize(x.dtype)."""
    return F.linear(x, weight.dequantize(x.dtype), bias)
