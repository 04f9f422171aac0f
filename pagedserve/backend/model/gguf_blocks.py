"""Exact unpacking of GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K..Q6_K and the 4-bit
non-linear IQ4_NL, IQ4_XS) into the canonical QuantizedWeight.

Each format is integers times a per-sub-block scale, plus a per-sub-block offset for the affine ones:
value = (d * sc) * q - (dmin * m). The scale d * sc (an fp16 times a small integer) and the offset -(dmin * m)
are exact in fp32, and QuantizedWeight.dequantize computes q * scale + offset in fp32, so it repeats the
arithmetic of gguf's own dequantizer (and llama.cpp's) bit for bit. Sub-blocks of 16 values (Q2_K, Q3_K, Q6_K)
become groups of 16; integers wider than 4 bits or signed ones are held as int8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedserve.kernels.quant_linear import QuantizedWeight, from_int_values
from pagedserve.kernels.quant_linear.layout import ScaleFactors

_CHUNK_VALUES = 1 << 22
# The 16 values an IQ4 nibble indexes (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class Unpacked(NamedTuple):
    """One format's blocks unpacked: q [B, values], scales and offsets [B, sub-blocks], bits and group size; for the
    super-block formats also the factoring they store, (int8 steps [B, sub-blocks], fp16 per block [B, 1]) for the
    scales and (when affine) the offsets."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    scale_factors: tuple[torch.Tensor, torch.Tensor] | None = None
    offset_factors: tuple[torch.Tensor, torch.Tensor] | None = None


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:  # [B, bytes] -> [B, 1] fp32 from the fp16 at byte `at`
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _factored(blocks: torch.Tensor, at: int, steps: torch.Tensor, negate: bool = False) -> tuple[torch.Tensor, ...]:
    """(the fp32 values d * steps, int8 steps, the fp16 d) of a super-block's scales or, negated, its offsets:
    -(dmin * m) == (-dmin) * m exactly."""
    d = blocks[:, at:at + 2].contiguous().view(torch.float16)
    d = -d if negate else d
    steps = steps.to(torch.int8)
    return d.float() * steps.float(), steps, d


def _spread(packed: torch.Tensor, shifts: tuple[int, ...] | range, mask: int) -> torch.Tensor:
    """[..., L] bytes -> [..., len(shifts), L]: each byte shifted right by each shift, masked."""
    shift = torch.tensor(list(shifts), dtype=torch.uint8).view(-1, 1)
    return (packed.unsqueeze(-2) >> shift) & mask


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # [B, S, L] -> [B, S * 2 * L]: low nibbles, then high
    return _spread(packed, (0, 4), 15).flatten(1)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, [B, 8] each."""
    d, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 63, (both & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (both >> 4) | ((m >> 2) & 48)], dim=-1)
    return scales, mins


def _five_bit_32(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1: 32 values 0..31 from 4 high-bit bytes at `at` (bit j is value j's) and 16 nibble bytes."""
    high = _spread(blocks[:, at:at + 4], range(8), 1).transpose(1, 2).flatten(1)  # byte i bit b -> value 8i + b
    return _nibbles(blocks[:, at + 4:at + 20].unsqueeze(1)) | (high << 4)


def _q8_0(b: torch.Tensor) -> Unpacked:
    return Unpacked(b[:, 2:34].contiguous().view(torch.int8), _half(b, 0).half(), None, 8, 32)


def _q4_0(b: torch.Tensor) -> Unpacked:
    d = _half(b, 0)
    return Unpacked(_nibbles(b[:, 2:18].unsqueeze(1)), d.half(), -8 * d, 4, 32)


def _q4_1(b: torch.Tensor) -> Unpacked:
    return Unpacked(_nibbles(b[:, 4:20].unsqueeze(1)), _half(b, 0).half(), _half(b, 2).half(), 4, 32)


def _q5_0(b: torch.Tensor) -> Unpacked:
    q = _five_bit_32(b, 2).to(torch.int8) - 16
    return Unpacked(q, _half(b, 0).half(), None, 8, 32)


def _q5_1(b: torch.Tensor) -> Unpacked:
    return Unpacked(_five_bit_32(b, 4), _half(b, 0).half(), _half(b, 2).half(), 8, 32)


def _q2_k(b: torch.Tensor) -> Unpacked:
    n, scales = b.shape[0], b[:, :16]
    q = _spread(b[:, 16:80].view(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 256)
    return _affine(q, _factored(b, 80, scales & 15), _factored(b, 82, scales >> 4, negate=True), 4, 16)


def _affine(q: torch.Tensor, scales: tuple[torch.Tensor, ...], offsets: tuple[torch.Tensor, ...] | None, bits: int,
            group_size: int) -> Unpacked:
    return Unpacked(q, scales[0], None if offsets is None else offsets[0], bits, group_size, scales[1:],
                    None if offsets is None else offsets[1:])


def _q3_k(b: torch.Tensor) -> Unpacked:
    n, packed = b.shape[0], b[:, 96:108]
    six_bit = _spread(packed[:, :8], (0, 4), 15).reshape(n, 16) | (_spread(packed[:, 8:], (0, 2, 4, 6), 3)
                                                                   .reshape(n, 16) << 4)
    low = _spread(b[:, 32:96].view(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 256).to(torch.int8)
    high = _spread(b[:, :32], range(8), 1).reshape(n, 256).to(torch.int8)
    # A clear high bit means 4 is subtracted.
    return _affine(low - 4 * (1 - high), _factored(b, 108, six_bit.to(torch.int8) - 32), None, 8, 16)


def _q4_k(b: torch.Tensor) -> Unpacked:
    n = b.shape[0]
    scales, mins = _k4_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:144].view(n, 4, 32))
    return _affine(q, _factored(b, 0, scales), _factored(b, 2, mins, negate=True), 4, 32)


def _q5_k(b: torch.Tensor) -> Unpacked:
    n = b.shape[0]
    scales, mins = _k4_scales(b[:, 4:16])
    q = _nibbles(b[:, 48:176].view(n, 4, 32)) | (_spread(b[:, 16:48], range(8), 1).reshape(n, 256) << 4)
    return _affine(q, _factored(b, 0, scales), _factored(b, 2, mins, negate=True), 8, 32)


def _q6_k(b: torch.Tensor) -> Unpacked:
    n = b.shape[0]
    low = _nibbles(b[:, :128].view(n, 2, 64))
    high = _spread(b[:, 128:192].view(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 256)
    scales = b[:, 192:208].contiguous().view(torch.int8)
    return _affine((low | (high << 4)).to(torch.int8) - 32, _factored(b, 208, scales), None, 8, 16)


def _iq4_nl(b: torch.Tensor) -> Unpacked:
    return Unpacked(_iq4(_nibbles(b[:, 2:18].unsqueeze(1))), _half(b, 0).half(), None, 8, 32)


def _iq4_xs(b: torch.Tensor) -> Unpacked:
    n = b.shape[0]
    low = ((b[:, 4:8].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15).reshape(n, 8)
    high_bits = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    high = (high_bits.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    scales = _factored(b, 0, (low.to(torch.int32) | (high << 4)) - 32)
    return _affine(_iq4(_nibbles(b[:, 8:136].view(n, 8, 16).unsqueeze(2)).view(n, 256)), scales, None, 8, 32)


def _iq4(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.int8)[nibbles.long()]


# GGUF type name -> (values per block, bytes per block, unpacker).
FORMATS: dict[str, tuple[int, int, Callable[[torch.Tensor], Unpacked]]] = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q2_K": (256, 84, _q2_k),
    "Q3_K": (256, 110, _q3_k),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
    "IQ4_NL": (32, 18, _iq4_nl),
    "IQ4_XS": (256, 136, _iq4_xs),
}


def unpack_blocks(kind: str, data: torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """A [rows, cols] tensor of GGUF type `kind` (a FORMATS key) from its raw uint8 bytes, exactly as stored."""
    values, size, unpack = FORMATS[kind]
    if cols % values or data.numel() != rows * cols // values * size:
        raise ValueError(f"{kind} data of {data.numel()} bytes does not hold [{rows}, {cols}] in blocks of {values}")
    # A few million values at a time: the unpacking's wide temporaries stay small beside a large token table.
    parts = [unpack(chunk) for chunk in data.reshape(-1, size).split(max(1, _CHUNK_VALUES // values))]
    first = parts[0]

    def joined(pick: Callable[[Unpacked], torch.Tensor]) -> torch.Tensor:
        return torch.cat([pick(p) for p in parts]).reshape(rows, -1)

    offsets = None if first.offsets is None else joined(lambda p: p.offsets)
    weight = from_int_values(torch.cat([p.q for p in parts]).reshape(rows, cols),  # uint8 / int8, no int32 copy
                             joined(lambda p: p.scales), offsets, first.bits, first.group_size)
    if first.scale_factors is not None:
        steps = [joined(lambda p, i=i: p.scale_factors[i]) for i in (0, 1)]
        if first.offset_factors is not None:
            steps += [joined(lambda p, i=i: p.offset_factors[i]) for i in (0, 1)]
        weight.factors = ScaleFactors(steps[0], steps[1], *(steps[2:] or [None, None]),
                                      values // first.group_size)
    return weight
