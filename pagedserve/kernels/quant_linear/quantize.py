"""Round-to-nearest quantization of a float weight into the canonical layout (on-the-fly `quantization`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.quant_linear.layout import QuantizedWeight, from_int_values

GROUP_SIZES = (32, 64, 128)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:  # [N, K] -> [N, G, group_size] fp32
    """The weight in fp32 cut into groups along K, the last one zero-padded."""
    n, k = weight.shape
    padded = F.pad(weight.to(torch.float32), (0, -k % group_size))
    return padded.view(n, -1, group_size)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8: one scale per output channel (W8A16), or per group of `group_size` columns."""
    k = weight.shape[1]
    group_size = group_size or k
    groups = _grouped(weight, group_size)
    scales = groups.abs().amax(dim=-1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).flatten(1)[:, :k]
    return from_int_values(q.to(torch.int32), scales, None, 8, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = 32, symmetric: bool = False) -> QuantizedWeight:
    """int4 per group of `group_size` columns (W4A16): min/max with offsets, or symmetric about zero."""
    k = weight.shape[1]
    groups = _grouped(weight, group_size)
    if symmetric:
        scales = groups.abs().amax(dim=-1) / 7
        offsets = None
    else:
        offsets = groups.amin(dim=-1)
        scales = (groups.amax(dim=-1) - offsets) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    if symmetric:
        q = torch.round(groups / scales[..., None]).clamp(-8, 7) + 8
        offsets = -8 * scales
    else:
        q = torch.round((groups - offsets[..., None]) / scales[..., None]).clamp(0, 15)
    return from_int_values(q.flatten(1)[:, :k].to(torch.int32), scales, offsets, 4, group_size)
