"""Linear layers with their weights prepacked for oneDNN, for the CPU path.

`F.linear` on the CPU lays the weight out for the GEMM kernel again on every call; prepacking once at load
time skips that (figures: docs/benchmarks.md, "Prepacked GEMM weights"). bf16 results are bit-identical;
in fp32 oneDNN sums in another order than MKL (relative differences ~1e-6), which the parity tests absorb.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def can_prepack(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN's packed linear ops and they run in `dtype` on this CPU.

    The bf16 and fp16 paths need CPU features (bf16: avx512bw/vl/dq or avx_ne_convert) that many CPUs lack:
    there oneDNN raises at the first reorder, so each dtype is tried once on a small layer.
    """
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    return _runs_in(dtype)


@functools.cache
def _runs_in(dtype: torch.dtype) -> bool:
    linear = nn.Linear(8, 8).to(dtype)
    try:
        with torch.no_grad():
            PackedLinear(linear, 1)(torch.ones(1, 8, dtype=dtype))
    except RuntimeError as error:
        logger.info("oneDNN packed linear does not run in %s on this CPU (%s); F.linear serves it", dtype, error)
        return False
    return True


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight prepacked for oneDNN; the plain weight is dropped."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                                          batch_hint))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b, as nn.Linear."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Replace every CPU nn.Linear whose dtype oneDNN runs here by a PackedLinear; returns how many were replaced
    (the others keep F.linear).

    A tied lm_head gets its own packed copy; the embedding keeps the plain table for lookups.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dim() == 2
                    and can_prepack(child.weight.dtype)):
                setattr(parent, name, PackedLinear(child, batch_hint))
                replaced += 1
    return replaced
