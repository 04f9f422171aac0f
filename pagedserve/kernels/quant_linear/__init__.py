"""Weight-only quantized linear (W8A16 / W4A16): x @ W.T with W held as integers, scales and offsets."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels.dispatch import Implementations
from pagedserve.kernels.quant_linear import cpu, reference
from pagedserve.kernels.quant_linear.layout import QuantizedWeight, from_int_values, pack_int4, unpack_int4
from pagedserve.kernels.quant_linear.quantize import quantize_int4, quantize_int8


def _load_triton() -> ModuleType:
    from pagedserve.kernels.quant_linear import triton

    return triton


_IMPLEMENTATIONS = Implementations(reference, cpu, _load_triton)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype."""
    return _IMPLEMENTATIONS.select(x).quant_linear(x, weight, bias)


def prepare(weight: QuantizedWeight, release: bool = True) -> int:
    """Build the backend's packed form of `weight` for its device now, dropping the canonical integers (and, for
    the native CPU form, scales and offsets) it duplicates unless `release` is False; returns the bytes the packed
    forms add."""
    module = _IMPLEMENTATIONS.select(torch.empty(0, device=weight.device))
    return module.prepare(weight, release) if hasattr(module, "prepare") else 0


__all__ = [
    "QuantizedWeight",
    "from_int_values",
    "pack_int4",
    "prepare",
    "quant_linear",
    "quantize_int4",
    "quantize_int8",
    "unpack_int4",
]
