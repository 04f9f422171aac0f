"""The canonical weight-only quantized weight every loader writes and every backend reads.

W[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size] (offsets 0 when None), in fp32.
int8 values are signed; int4 values are unsigned 0..15, two per byte (even k in the low nibble), so a
symmetric int4 weight carries offsets = -8 * scales. Every source maps onto this form without rounding:
GGUF Q8_0 (offsets None), Q4_0 (offsets -8d), Q4_1 (offsets m), the K-quants (groups of 16 or 32, scales d * sc,
offsets -dmin * m, also kept factored: ScaleFactors), GPTQ/AWQ (offsets -zero * scale).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

BITS = (4, 8)
# rows (all: None) -> (scales, offsets or None) of those rows.
ParamsUnpacker = Callable[[torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]


class ScaleFactors(NamedTuple):
    """Scales (and offsets) factored as int8 steps per group times an fp16 per super-block of `per_super` groups,
    as GGUF's K-quants store them (d * sc, -dmin * m): scales == super.repeat_interleave(per_super) * steps exactly
    in fp32. A backend may hold these instead of fp32 scales."""

    scale_steps: torch.Tensor  # int8 [N, G]
    scale_super: torch.Tensor  # fp16 [N, G / per_super]
    offset_steps: torch.Tensor | None  # like scale_steps, or None (no offsets)
    offset_super: torch.Tensor | None
    per_super: int

    def rows(self, rows: torch.Tensor) -> ScaleFactors:
        """The factors of `rows`."""
        pick = lambda t: None if t is None else t[rows].contiguous()  # noqa: E731
        return ScaleFactors(pick(self.scale_steps), pick(self.scale_super), pick(self.offset_steps),
                            pick(self.offset_super), self.per_super)

    def to(self, device: torch.device | str) -> ScaleFactors:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ScaleFactors(*(move(t) for t in self[:4]), self.per_super)


@dataclass(eq=False)
class QuantizedWeight:
    """A [out_features, in_features] weight as integers, per-group scales and optional per-group offsets."""

    qweight: torch.Tensor  # bits 8: int8 [N, K]; bits 4: uint8 [N, ceil(K / 2)]
    scales: torch.Tensor  # [N, ceil(K / group_size)] float (None once released: release_params)
    offsets: torch.Tensor | None  # like scales, or None
    bits: int
    group_size: int  # in_features for one scale per output channel
    in_features: int
    # Backend-specific packed forms built from the tensors above on first use (pagedserve/kernels/quant_linear/cpu.py).
    packed: dict[str, Any] = field(default_factory=dict, repr=False)
    # Set when a backend's packed form replaced qweight (release_qweight): the integers of some rows (all: None).
    unpacker: Callable[[torch.Tensor | None], torch.Tensor] | None = field(default=None, repr=False)
    # Set when a backend's packed form replaced scales and offsets (release_params): (scales, offsets) of some rows.
    params_unpacker: ParamsUnpacker | None = field(default=None, repr=False)
    # The scales and offsets factored as the source stored them (GGUF K-quants), or None.
    factors: ScaleFactors | None = field(default=None, repr=False)
    _out_features: int = field(default=0, init=False, repr=False)
    _has_offsets: bool = field(default=False, init=False, repr=False)
    _device: torch.device = field(default=torch.device("cpu"), init=False, repr=False)

    def __post_init__(self) -> None:
        self._out_features, self._has_offsets = self.scales.shape[0], self.offsets is not None
        self._device = self.scales.device
        n, k, groups = self.out_features, self.in_features, self.num_groups
        if self.bits not in BITS:
            raise ValueError(f"quantized weights have 4 or 8 bits, got {self.bits}")
        if self.group_size < 1 or (self.bits == 4 and self.group_size % 2 and self.group_size < k):
            raise ValueError(f"int4 groups must be whole bytes (an even group_size), got {self.group_size}")
        want = (torch.int8, (n, k)) if self.bits == 8 else (torch.uint8, (n, (k + 1) // 2))
        if (self.qweight.dtype, tuple(self.qweight.shape)) != want:
            raise ValueError(f"{self.bits}-bit qweight must be {want[0]} {want[1]}, got "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        if self.factors is not None and (self.num_groups % self.factors.per_super or tuple(
                self.factors.scale_steps.shape) != (n, groups) or (self.factors.offset_steps is None) != (
                self.offsets is None)):
            raise ValueError(f"scale factors must be int8 steps [{n}, {groups}] in whole super-blocks, with offset "
                             f"steps exactly when there are offsets")
        for name in ("scales", "offsets"):
            tensor = getattr(self, name)
            if tensor is not None and (tuple(tensor.shape) != (n, groups) or not tensor.is_floating_point()):
                raise ValueError(f"{name} must be a float [{n}, {groups}] tensor, got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")

    @property
    def out_features(self) -> int:
        return self._out_features

    @property
    def has_offsets(self) -> bool:
        """Whether the weight has offsets (held, or released with the scales)."""
        return self._has_offsets

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    @property
    def device(self) -> torch.device:
        return self._device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (those released to a packed form absent)."""
        named = {"qweight": self.qweight, "scales": self.scales, "offsets": self.offsets}
        if self.factors is not None:
            named.update(zip(("scale_steps", "scale_super", "offset_steps", "offset_super"), self.factors[:4],
                             strict=True))
        return {name: t for name, t in named.items() if t is not None}

    def release_qweight(self, unpacker: Callable[[torch.Tensor | None], torch.Tensor]) -> None:
        """Drop qweight once a backend's packed form holds the same integers; `unpacker(rows)` gives them back."""
        self.qweight, self.unpacker = None, unpacker

    def release_params(self, unpacker: ParamsUnpacker) -> None:
        """Drop scales and offsets once a backend's packed form holds the same values; `unpacker(rows)` gives
        (scales, offsets) back, exactly (perhaps in another float dtype)."""
        self.scales, self.offsets, self.factors, self.params_unpacker = None, None, None, unpacker

    def params(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales, offsets or None) of `rows` (all: None), from the packed form when released."""
        if self.scales is None:
            return self.params_unpacker(rows)
        if rows is None:
            return self.scales, self.offsets
        return self.scales[rows], None if self.offsets is None else self.offsets[rows]

    def canonical_qweight(self) -> torch.Tensor:
        """qweight, rebuilt from the packed form when it was released."""
        if self.qweight is not None:
            return self.qweight
        q = self.int_values()
        return q.to(torch.int8) if self.bits == 8 else pack_int4(q)

    def nbytes(self) -> int:
        """Bytes of the stored tensors, packed forms excluded."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def packed_nbytes(self) -> int:
        """Bytes the packed forms add (a form that reuses a stored tensor adds nothing)."""
        seen = {t.data_ptr() for t in self.tensors().values()}
        total, pending = 0, list(self.packed.values())
        while pending:
            item = pending.pop()
            if isinstance(item, tuple | list):
                pending.extend(item)
            elif isinstance(item, torch.Tensor) and item.data_ptr() not in seen:
                seen.add(item.data_ptr())
                total += item.numel() * item.element_size()
        return total

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on another device (packed forms are rebuilt there); itself when already there."""
        if self.device == torch.device(device):
            return self
        scales, offsets = self.params()
        factors = None if self.factors is None else self.factors.to(device)
        return QuantizedWeight(self.canonical_qweight().to(device), scales.to(device),
                               None if offsets is None else offsets.to(device), self.bits, self.group_size,
                               self.in_features, factors=factors)

    def int_values(self, rows: torch.Tensor | None = None) -> torch.Tensor:  # [N or len(rows), K] int32
        """The integers q (of `rows` only, when given), unpacked."""
        if self.qweight is None:
            return self.unpacker(rows)
        packed = self.qweight if rows is None else self.qweight[rows]
        return packed.to(torch.int32) if self.bits == 8 else unpack_int4(packed, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """W (or its `rows`) computed in fp32 and then cast to `dtype`."""
        q = self.int_values(rows)
        scales, offsets = self.params(rows)
        w = q.to(torch.float32) * _per_column(scales, self.group_size, self.in_features)
        if offsets is not None:
            w = w + _per_column(offsets, self.group_size, self.in_features)
        return w.to(dtype)


def _per_column(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[..., G] -> [..., K] fp32, each group's value repeated over its columns."""
    return per_group.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :in_features]


def pack_int4(values: torch.Tensor) -> torch.Tensor:  # [..., K] ints 0..15 -> [..., ceil(K/2)] uint8
    """Two 4-bit values per byte, even k in the low nibble (an odd K pads a zero high nibble)."""
    if values.numel() and (values.min() < 0 or values.max() > 15):
        raise ValueError("int4 values must lie in 0..15")
    values = values.to(torch.uint8)
    if values.shape[-1] % 2:
        values = torch.nn.functional.pad(values, (0, 1))
    return values[..., 0::2] | (values[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:  # -> [..., K] int32
    """pack_int4's inverse."""
    low = (packed & 15).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).flatten(-2)[..., :in_features]


def from_int_values(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
                    group_size: int) -> QuantizedWeight:
    """A QuantizedWeight from unpacked integers [N, K] (signed for 8 bits, 0..15 for 4)."""
    in_features = q.shape[-1]
    if bits == 8:
        if q.numel() and (q.min().item() < -128 or q.max().item() > 127):  # Python ints: uint8 q compares right
            raise ValueError("int8 values must lie in -128..127")
        qweight = q.to(torch.int8)
    else:
        qweight = pack_int4(q)
    return QuantizedWeight(qweight.contiguous(), scales.contiguous(),
                           None if offsets is None else offsets.contiguous(), bits, group_size, in_features)


def select_rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    """The weight's output rows in the order of `rows` (exact: rows carry their own scales)."""
    scales, offsets = weight.params(rows)
    factors = None if weight.factors is None else weight.factors.rows(rows)
    return QuantizedWeight(weight.canonical_qweight()[rows].contiguous(), scales.contiguous(),
                           None if offsets is None else offsets.contiguous(), weight.bits, weight.group_size,
                           weight.in_features, factors=factors)


def regroup(weight: QuantizedWeight, group_size: int) -> QuantizedWeight:
    """The same weight with groups of `group_size`, which divides its own (each group's scale and offset repeated:
    exact)."""
    if weight.group_size == group_size:
        return weight
    if weight.group_size % group_size or weight.in_features % weight.group_size:
        raise ValueError(f"groups of {weight.group_size} over {weight.in_features} columns do not split into groups "
                         f"of {group_size}")
    times = weight.group_size // group_size
    scales, offsets = weight.params()
    factors = weight.factors
    if factors is not None:
        spread = lambda t: None if t is None else t.repeat_interleave(times, dim=1)  # noqa: E731
        factors = ScaleFactors(spread(factors.scale_steps), factors.scale_super, spread(factors.offset_steps),
                               factors.offset_super, factors.per_super * times)
    return QuantizedWeight(weight.canonical_qweight(), scales.repeat_interleave(times, dim=1),
                           None if offsets is None else offsets.repeat_interleave(times, dim=1), weight.bits,
                           group_size, weight.in_features, factors=factors)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are each weight's in turn (a fused projection); int4 parts widen to int8 when the
    bits differ (the same values, scales and offsets), scales and offsets to fp32 when their dtypes differ, and
    larger groups split into the smallest part's when it divides them (GGUF Q4_K_M mixes groups of 32 and 16)."""
    if any(w.in_features != weights[0].in_features for w in weights):
        raise ValueError(f"fused parts need the same input width: {[w.in_features for w in weights]}")
    smallest = min(w.group_size for w in weights)
    if all(w.group_size % smallest == 0 and w.in_features % w.group_size == 0 for w in weights):
        weights = [regroup(w, smallest) for w in weights]
    first = weights[0]
    if any(w.group_size != first.group_size for w in weights):
        raise ValueError("fused parts need the same group size (or whole groups that the smallest divides): "
                         f"{[(w.group_size, w.in_features) for w in weights]}")
    bits = max(w.bits for w in weights)
    any_offsets = any(w.has_offsets for w in weights)
    params = [w.params() for w in weights]

    def common(tensors: list[torch.Tensor]) -> torch.Tensor:
        same = all(t.dtype == tensors[0].dtype for t in tensors)
        return torch.cat(tensors if same else [t.to(torch.float32) for t in tensors])

    def offsets(scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        return offsets if offsets is not None else torch.zeros_like(scales)

    if bits == 4:
        qweight = torch.cat([w.canonical_qweight() for w in weights])
    else:
        qweight = torch.cat([w.canonical_qweight() if w.bits == 8 else w.int_values().to(torch.int8) for w in weights])
    return QuantizedWeight(qweight, common([scales for scales, _ in params]),
                           common([offsets(*p) for p in params]) if any_offsets else None, bits,
                           first.group_size, first.in_features, factors=_concat_factors(weights, any_offsets))


def _concat_factors(weights: list[QuantizedWeight], any_offsets: bool) -> ScaleFactors | None:
    """The parts' factors stacked when every part has them with one super-block size (parts without offsets
    get zero offset steps); else None."""
    factors = [w.factors for w in weights]
    if any(f is None for f in factors) or len({f.per_super for f in factors}) > 1:
        return None

    def offset_part(f: ScaleFactors) -> tuple[torch.Tensor, torch.Tensor]:
        if f.offset_steps is not None:
            return f.offset_steps, f.offset_super
        return torch.zeros_like(f.scale_steps), torch.zeros_like(f.scale_super)

    offset_parts = [offset_part(f) for f in factors] if any_offsets else None
    return ScaleFactors(torch.cat([f.scale_steps for f in factors]), torch.cat([f.scale_super for f in factors]),
                        None if offset_parts is None else torch.cat([steps for steps, _ in offset_parts]),
                        None if offset_parts is None else torch.cat([sup for _, sup in offset_parts]),
                        factors[0].per_super)
