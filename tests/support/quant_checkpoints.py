"""GPTQ, AWQ and compressed-tensors packing as the tests write it, and a tiny model saved in one of those formats
beside its dequantized fp32 twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack(values: np.ndarray, bits: int, axis: int) -> torch.Tensor:
    """Unsigned `bits`-wide values into int32 words along `axis`: value j * pack + i in field i of word j."""
    per = 32 // bits
    values = np.moveaxis(values.astype(np.uint64), axis, -1)
    values = values.reshape(*values.shape[:-1], -1, per)
    words = sum(values[..., i] << np.uint64(bits * i) for i in range(per)).astype(np.uint32)
    return torch.from_numpy(np.moveaxis(words, -1, axis).view(np.int32).copy())


def awq_pack(values: np.ndarray) -> torch.Tensor:
    """AWQ's GEMM packing along the last axis: word j holds column 8j + AWQ_ORDER[i] in nibble i."""
    cols = values.shape[-1]
    reordered = values.reshape(-1, cols // 8, 8)[..., AWQ_ORDER].reshape(values.shape)
    return pack(reordered, 4, 1)


def gptq_parts(q, zeros, scales, bits, v2=False):
    """GPTQ's qweight, qzeros and scales of the integers q [N, K]."""
    stored = zeros if v2 else (zeros - 1) & ((1 << bits) - 1)  # v1 stores zero - 1 (0 wraps to 2^bits - 1)
    return {"qweight": pack(q.T, bits, 0), "qzeros": pack(stored.T, bits, 1),
            "scales": torch.from_numpy(scales.T.copy())}


def awq_parts(q, zeros, scales):
    """AWQ's (GEMM layout) qweight, qzeros and scales of the 4-bit integers q [N, K]."""
    return {"qweight": awq_pack(q.T), "qzeros": awq_pack(zeros.T), "scales": torch.from_numpy(scales.T.copy())}


def ct_parts(q, zeros, scales, bits, symmetric):
    """q and zeros here are unsigned: compressed-tensors' signed values and zero points + 2^(bits-1)."""
    parts = {"weight_packed": pack(q, bits, 1), "weight_scale": torch.from_numpy(scales.copy()),
             "weight_shape": torch.tensor(q.shape)}
    if not symmetric:
        parts["weight_zero_point"] = pack(zeros, bits, 0)
    return parts


def packed_parts(method, q, zeros, scales, bits, symmetric=False):
    """One projection's tensors in `method`'s format ("gptq_v2": GPTQ storing the zeros themselves)."""
    if method in ("gptq", "gptq_v2"):
        return gptq_parts(q, zeros, scales, bits, v2=method == "gptq_v2")
    if method == "awq":
        return awq_parts(q, zeros, scales)
    return ct_parts(q, zeros, scales, bits, symmetric)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rtn(w: torch.Tensor, bits: int, group: int):
    """Asymmetric round-to-nearest with integer zeros, as GPTQ/AWQ store them: q, zeros, fp16 scales."""
    g = w.float().view(w.shape[0], -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / ((1 << bits) - 1)).clamp(min=1e-6).to(torch.float16)
    zeros = torch.round(-lo / scales.float()).clamp(0, (1 << bits) - 1)
    q = (torch.round(g / scales.float()[..., None]) + zeros[..., None]).clamp(0, (1 << bits) - 1)
    return q.flatten(1).int().numpy(), zeros.int().numpy(), scales.numpy()


def write_quantized_checkpoint(source: Path, target: Path, method: str, bits: int, group: int,
                               projections: tuple[str, ...] = PROJECTIONS) -> Path:
    """The tiny model with its `projections` in `method`'s format, and its dequantized twin at target.ref."""
    shutil.copytree(source, target)
    shutil.copytree(source, target.with_suffix(".ref"))
    tensors, twin = load_file(str(source / "model.safetensors")), {}
    out = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rsplit(".", 1)[-1] not in projections or leaf != "weight":
            out[name] = twin[name] = tensor
            continue
        q, zeros, scales = quantize_rtn(tensor, bits, group)
        parts = packed_parts(method, q, zeros, scales, bits)
        out.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
        twin[name] = torch.from_numpy((q - np.repeat(zeros, group, 1)).astype(np.float32)
                                      * np.repeat(scales.astype(np.float32), group, 1))
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(target.with_suffix(".ref") / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": False},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
        "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "symmetric": False,
                                                           "strategy": "group", "group_size": group}}}},
    }[method]
    (target / "config.json").write_text(json.dumps(config))
    return target
