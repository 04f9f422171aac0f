"""The CPU quantized linear: the native GEMM (`quant_gemm.cpp`) where it loads and fits the layout, else
torch's packed weight-only kernels where they fit, else the reference.

The native kernel computes in fp32 from the exact integers and scales, for fp32 and bf16 activations, and
measured faster than torch's kernels at every batch size tried (docs/benchmarks.md, "Quantized weights").
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` are vectorised for bf16 activations only (fp32 ones
ran 10-50x slower than fp32 oneDNN here), so they run in bf16, scales and zeros included. Whichever packed
form serves a weight is built once and kept in it.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.quant_linear import native_gemm, reference
from pagedserve.kernels.quant_linear.layout import QuantizedWeight

COMPUTE_DTYPE = torch.bfloat16
_INT4_GROUP_SIZES = (32, 64, 128, 256)
_INT4_ROW_TILE = 16  # the int4 packing works on whole tiles of output rows
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def int4_fits(weight: QuantizedWeight) -> bool:
    """True when torch's int4 CPU kernel serves this layout: whole groups of a size it knows, whole row tiles."""
    return (weight.bits == 4 and weight.group_size in _INT4_GROUP_SIZES and weight.in_features % weight.group_size == 0
            and weight.out_features % _INT4_ROW_TILE == 0)


def int8_fits(weight: QuantizedWeight) -> bool:
    """True when torch's int8 CPU kernel serves it, one call per group: whole groups (or one per channel)."""
    return weight.bits == 8 and weight.in_features % weight.group_size == 0


def _int4_packed(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's int4 pack, scales and zeros [G, N, 2]); torch dequantizes (q - 8) * scale + zero."""
    if "cpu_int4" not in weight.packed:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.int_values(), 2)
        scales, offsets = weight.params()
        scales = scales.to(torch.float32)
        offsets = offsets.to(torch.float32) if offsets is not None else torch.zeros_like(scales)
        zeros = offsets + 8 * scales
        scale_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)
        weight.packed["cpu_int4"] = (packed, scale_and_zeros)
    return weight.packed["cpu_int4"]


def _int8_packed(weight: QuantizedWeight) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per group: (int8 [N, group_size] contiguous, bf16 scales [N], fp32 offsets [N] or None).

    One scale per channel is the canonical tensor itself; groups get their own contiguous copies.
    """
    if "cpu_int8" not in weight.packed:
        groups = []
        qweight, (scales, all_offsets) = weight.canonical_qweight(), weight.params()
        for g in range(weight.num_groups):
            cols = slice(g * weight.group_size, (g + 1) * weight.group_size)
            q = qweight if weight.num_groups == 1 else qweight[:, cols].contiguous()
            offsets = None if all_offsets is None else all_offsets[:, g].to(torch.float32).contiguous()
            groups.append((q, scales[:, g].to(COMPUTE_DTYPE).contiguous(), offsets))
        weight.packed["cpu_int8"] = groups
    return weight.packed["cpu_int8"]


def _native_packed(weight: QuantizedWeight) -> native_gemm.NativePacked | None:
    """The native kernel's packed form, built on first use; None where the native kernel does not serve it
    (PAGEDSERVE_CPU_KERNELS is read then, when the form is built, not on every call)."""
    packed = weight.packed.get("cpu_native")
    if packed is None and "cpu_int4" not in weight.packed and "cpu_int8" not in weight.packed \
            and native_gemm.fits(weight):
        packed = weight.packed["cpu_native"] = native_gemm.pack(weight)
    return packed


def prepare(weight: QuantizedWeight, release: bool = True) -> int:
    """Build the packed form now (at load, not in the first step) and, with `release`, drop the canonical qweight
    it duplicates, and the scales and offsets where the native form holds them (all stay readable through the
    packed form); returns the bytes the forms add."""
    packed = _native_packed(weight)
    if packed is not None:
        if release and weight.qweight is not None:
            weight.release_qweight(native_gemm.unpacker(packed, weight))
        if release and weight.scales is not None:
            weight.release_params(native_gemm.params_unpacker(packed))
    elif int4_fits(weight):
        packed, _ = _int4_packed(weight)
        if release and weight.qweight is not None:
            weight.release_qweight(_int4_unpacker(packed, weight))
    elif int8_fits(weight):
        groups = _int8_packed(weight)
        if release and weight.num_groups > 1 and weight.qweight is not None:
            weight.release_qweight(lambda rows: torch.cat([q if rows is None else q[rows] for q, _, _ in groups],
                                                          dim=1).to(torch.int32))
    return weight.packed_nbytes()


def _int4_unpacker(packed: torch.Tensor, weight: QuantizedWeight):
    """The integers read back through torch's own kernel (its layout is private to it): with scale 1 and zero 8
    it dequantizes q - 8 + 8 = q, and the identity times that is q exactly."""
    k, groups = weight.in_features, weight.num_groups
    ones = torch.stack([torch.ones(groups, weight.out_features), torch.full((groups, weight.out_features), 8.0)],
                       dim=-1).to(COMPUTE_DTYPE)

    def unpack(rows: torch.Tensor | None) -> torch.Tensor:
        eye = torch.eye(k, dtype=COMPUTE_DTYPE)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, weight.group_size, ones).T.to(torch.int32)
        return q if rows is None else q[rows]

    return unpack


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.quant_linear.quant_linear on the CPU."""
    packed = _native_packed(weight) if x.dtype in _NATIVE_DTYPES else None
    if packed is not None:
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
        out = native_gemm.gemm(rows, packed)
        out = out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)
        return out if bias is None else out + bias
    if int4_fits(weight):
        packed, scale_and_zeros = _int4_packed(weight)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(_rows(x), packed, weight.group_size, scale_and_zeros)
    elif int8_fits(weight):
        out = _int8_mm(_rows(x), weight)
    else:
        return reference.quant_linear(x, weight, bias)
    out = out.view(*x.shape[:-1], weight.out_features).to(x.dtype)
    return out if bias is None else out + bias


def _int8_mm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:  # [M, K] bf16 -> [M, N] fp32
    """Sum over groups of scale * (x_g @ q_g.T) + offset * sum(x_g), each group one torch int8 call."""
    out = None
    size = weight.group_size
    for g, (q, scales, offsets) in enumerate(_int8_packed(weight)):
        x_g = x if weight.num_groups == 1 else x[:, g * size:(g + 1) * size].contiguous()
        part = torch.ops.aten._weight_int8pack_mm(x_g, q, scales).float()
        if offsets is not None:
            part += x_g.float().sum(-1, keepdim=True) * offsets
        out = part if out is None else out.add_(part)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()
