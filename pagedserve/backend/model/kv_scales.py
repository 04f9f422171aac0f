"""An fp8-KV checkpoint's per-layer K/V cache scales, read at load and set on each layer's attention once.

Names as vLLM reads them: llm-compressor / compressed-tensors `...layers.N.self_attn.k_scale` and `v_scale`
(also under `self_attn.attn.`), ModelOpt's `self_attn.k_proj.k_scale` / `v_proj.v_scale`, the older
`k_proj.output_scale` / `v_proj.output_scale`, and the deprecated `self_attn.kv_scale` (both K and V). A scale is
per tensor: the cache holds K / k_scale (kernels.kv8). Layers without one keep 1.0, or computed ones
(calculate_kv_scales: kv_calibration.py, which keeps the checkpoint's).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from pagedserve.backend.model.llama import Attention

_KV_SCALE = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.self_attn\."
    r"(?:(?:attn\.)?(?P<direct>[kv])_scale|(?P<proj>[kv])_proj\.(?:[kv]_scale|output_scale)|(?P<both>kv)_scale)$"
)

KVScales = dict[int, dict[str, float]]  # layer index -> {"k_scale": s, "v_scale": s}
# The attribute of an Attention naming the scales its checkpoint gave ({"k_scale", "v_scale"} or part): kept as
# given when the others are computed (kv_calibration.py).
CHECKPOINT_SCALES = "checkpoint_kv_scales"


def take_kv_scale(name: str, tensor: torch.Tensor, found: KVScales) -> bool:
    """Record `tensor` in `found` if `name` is a KV cache scale (True), else leave it to the weights (False)."""
    match = _KV_SCALE.search(name)
    if match is None or "vision" in name:
        return False
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} holds {tensor.numel()} KV cache scales; only one scale per "
                         "tensor (per layer) is supported")
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"checkpoint tensor {name!r} is a KV cache scale of {value}; it must be positive")
    kinds = ("k", "v") if match["both"] else (match["direct"] or match["proj"],)
    layer = found.setdefault(int(match["layer"]), {})
    for kind in kinds:
        layer[f"{kind}_scale"] = value
    return True


def apply_kv_scales(model: nn.Module, found: KVScales) -> None:
    """Set each decoder attention's k_scale / v_scale from `found` (those absent stay 1.0)."""
    if not found:
        return
    for module in model.modules():
        if isinstance(module, Attention) and module.layer_idx in found:
            for attr, value in found[module.layer_idx].items():
                setattr(module, attr, value)
            setattr(module, CHECKPOINT_SCALES, frozenset(found[module.layer_idx]))
