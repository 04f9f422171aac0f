"""Quantized safetensors checkpoints (config.json `quantization_config`): GPTQ, AWQ and compressed-tensors
pack-quantized, each projection's tensors unpacked exactly into the canonical QuantizedWeight.

GPTQ (AutoGPTQ's format): qweight int32 [K / pack, N] packed along K, qzeros int32 [G, N / pack] packed along
N holding zero - 1 (checkpoint_format "gptq"; "gptq_v2" holds the zero), scales [G, N]; W = (q - zero) * s.
AWQ (GEMM): qweight int32 [K, N / 8] and qzeros [G, N / 8] packed along N in AWQ's order, scales [G, N].
compressed-tensors pack-quantized: weight_packed int32 [N, K / pack] holding q + 2^(bits-1), weight_scale
[N, G], weight_zero_point (asymmetric) int32 [N / pack, G] packed along N, also + 2^(bits-1); W = (q - zero) * s
with q and zero signed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.kernels.quant_linear import QuantizedWeight, from_int_values

METHODS = ("gptq", "awq", "compressed-tensors")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ packs column 8j + _AWQ_ORDER[i] into nibble i of word j
_SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}


class QuantFormatError(ValueError):
    """A quantization_config or quantized tensor pagedserve does not load; the message names it."""


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint stores its quantized projections."""

    method: str
    bits: int
    group_size: int  # -1: one group per output channel
    symmetric: bool
    zeros_minus_one: bool = False  # GPTQ v1 stores zero - 1

    def owns(self, tensor_name: str) -> bool:
        """True for a tensor that is part of a quantized projection in this format."""
        return tensor_name.rsplit(".", 1)[-1] in _SUFFIXES[self.method]

    def to_weight(self, parts: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
        """One projection's tensors (by suffix) as a QuantizedWeight."""
        try:
            unpack = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}[self.method]
            return unpack(self, parts, name)
        except KeyError as missing:
            raise QuantFormatError(f"{self.method} projection {name!r} lacks its tensor {missing}") from None


def scheme_from_config(raw: dict[str, Any]) -> Scheme | None:
    """The Scheme of a config.json dict, None without quantization_config; QuantFormatError naming what is
    unsupported (method, bits, desc_act / actorder, format)."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise QuantFormatError(f"quantization_config.quant_method {method!r} is not supported; supported: "
                               f"{', '.join(METHODS)}")
    if method == "compressed-tensors":
        return _compressed_scheme(qc)
    bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise QuantFormatError(f"{method} with bits {bits} is not supported; supported: "
                               f"{'4, 8' if method == 'gptq' else '4'}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantFormatError(f"awq version {version!r} is not supported; supported: gemm")
        return Scheme("awq", 4, group, symmetric=not qc.get("zero_point", True))
    if qc.get("desc_act"):
        raise QuantFormatError("gptq desc_act (activation order) is not supported: its groups are not contiguous "
                               "columns; re-quantize with desc_act=false")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    return Scheme("gptq", bits, group, bool(qc.get("sym", True)), zeros_minus_one=fmt != "gptq_v2")


def _compressed_scheme(qc: dict[str, Any]) -> Scheme:
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise QuantFormatError(f"compressed-tensors format {fmt!r} is not supported; supported: pack-quantized")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or not groups[0].get("weights") or groups[0].get("input_activations"):
        raise QuantFormatError("compressed-tensors: only one weight-only config group (WnA16) is supported")
    w = groups[0]["weights"]
    if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) not in (4, 8):
        raise QuantFormatError(f"compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit are not "
                               "supported; supported: int 4 and 8")
    if w.get("actorder") not in (None, False, "static"):
        raise QuantFormatError(f"compressed-tensors actorder {w.get('actorder')!r} is not supported")
    strategy = w.get("strategy", "group")
    if strategy not in ("group", "channel"):
        raise QuantFormatError(f"compressed-tensors strategy {strategy!r} is not supported; supported: group, "
                               "channel")
    group = int(w.get("group_size") or -1) if strategy == "group" else -1
    return Scheme("compressed-tensors", int(w["num_bits"]), group, bool(w.get("symmetric", True)))


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their bits-wide fields, field i of word j at index j * pack + i along `dim` (int32)."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = words.to(torch.int32).movedim(dim, -1)
    fields = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], words.shape[-1] * pack).movedim(-1, dim)


def _group_size(scheme: Scheme, in_features: int) -> int:
    return in_features if scheme.group_size in (-1, 0) else scheme.group_size


def _canonical(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int,
               group_size: int) -> QuantizedWeight:
    """From unsigned q [N, K] with W = (q - zero) * scale: int4 keeps q and offsets -zero * scale; int8 stores
    q - 128 with offsets (128 - zero) * scale (both exact in fp32 for fp16/bf16 scales)."""
    if bits == 8:
        q, zeros = q - 128, zeros - 128
    offsets = -(zeros.to(torch.float32) * scales.to(torch.float32))
    return from_int_values(q, scales, offsets, bits, group_size)


def _check_groups(g_idx: torch.Tensor | None, group_size: int, name: str) -> None:
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(g_idx.numel()) // group_size):
        raise QuantFormatError(f"{name}: g_idx is not contiguous groups of {group_size} (activation order); "
                               "not supported")


def _gptq(scheme: Scheme, parts: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    q = _unpack_words(parts["qweight"], scheme.bits, 0).T  # [N, K]
    group_size = _group_size(scheme, q.shape[1])
    _check_groups(parts.get("g_idx"), group_size, name)
    zeros = _unpack_words(parts["qzeros"], scheme.bits, 1).T  # [N, G]
    if scheme.zeros_minus_one:
        zeros = (zeros + 1) & ((1 << scheme.bits) - 1)
    return _canonical(q.contiguous(), zeros.contiguous(), parts["scales"].T.contiguous(), scheme.bits, group_size)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, N / 8] -> [R, N] in column order."""
    fields = _unpack_words(words, 4, 1)
    order = torch.tensor(_AWQ_ORDER)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(8)
    return fields.view(fields.shape[0], -1, 8)[..., inverse].reshape(fields.shape)


def _awq(scheme: Scheme, parts: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    q = _awq_columns(parts["qweight"]).T  # [N, K]
    zeros = _awq_columns(parts["qzeros"]).T
    return _canonical(q.contiguous(), zeros.contiguous(), parts["scales"].T.contiguous(), 4,
                      _group_size(scheme, q.shape[1]))


def _compressed(scheme: Scheme, parts: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    offset = 1 << (scheme.bits - 1)
    q = _unpack_words(parts["weight_packed"], scheme.bits, 1)[:, :cols]  # unsigned: signed value + offset
    scales = parts["weight_scale"]
    group_size = cols if scales.shape[1] == 1 else _group_size(scheme, cols)
    _check_groups(parts.get("weight_g_idx"), group_size, name)
    if scheme.symmetric or "weight_zero_point" not in parts:
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    else:
        zeros = _unpack_words(parts["weight_zero_point"], scheme.bits, 0)[:rows]  # packed with the offset too
    if q.shape[0] != rows:
        raise QuantFormatError(f"{name}: weight_packed has {q.shape[0]} rows, weight_shape says {rows}")
    return _canonical(q.contiguous(), zeros.contiguous(), scales.contiguous(), scheme.bits, group_size)
