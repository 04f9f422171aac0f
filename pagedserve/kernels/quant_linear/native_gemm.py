"""The native weight-only GEMM for few activation rows (`quant_gemm.cpp`): its packed layout and its call.

The weight is packed once into tiles of 16 output rows, k-major inside a tile (one vector lane per output row;
int4: one 32-bit word per row and 8 k, its nibbles in NIBBLE_K's order), scales and offsets beside it per tile and
group: as int8 steps times an fp16 per super-block where the weight
carries that factoring (GGUF K-quants), else fp16 where that holds them exactly, else fp32.
An int8 weight whose integers span at most 16, 32 or 64 values (GGUF's Q3_K, Q5_0, Q5_1, Q5_K, Q6_K) is held as
4-, 5- or 6-bit codes q - bias: int4 words of the low nibbles and, for 5 and 6 bits, a word per row of the high
bits per chunk of 32 or 16 k (HIGH_BITS_AT), which the kernel unpacks in registers.
One bf16 activation row against int8 tiles or 5- and 6-bit codes (GGUF Q8_0, Q5_*, Q6_K: a decode step) runs exact
integer dot products where the CPU has AVX-512 VNNI and VBMI (`quant_gemv_i8.cpp`: the row's groups as int8 digits,
int32 sums per digit, the codes unpacked with vpmultishiftqb).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from pagedserve.kernels import native
from pagedserve.kernels.native.split import RangeSplitter
from pagedserve.kernels.quant_linear.layout import QuantizedWeight

TILE = 16
# int4: the k (from the word's first) each nibble of a row's 32-bit word holds, nibble 0 the lowest (kNibbleK in
# quant_gemm.cpp): a 16-bit shift by 4i then gives the pair (2i, 2i + 1) in each word's halves.
NIBBLE_K = (0, 2, 4, 6, 1, 3, 5, 7)
_NIBBLE_OF_K = tuple(NIBBLE_K.index(k) for k in range(8))
# Narrow codes: code bits -> k per chunk (int4: per word); the high bits of a chunk's k (its index kk) sit in the
# chunk's high word at bit HIGH_BITS_AT[bits][kk] (high_pos in quant_gemm.cpp).
CHUNK_K = {4: 8, 5: 32, 6: 16}
HIGH_BITS_AT = {bits: tuple((kk % 2) * 16 + (4 * (kk // 8) + kk % 8 // 2) * (bits - 4) for kk in range(CHUNK_K[bits]))
                for bits in (5, 6)}
# Whether int8 weights of a narrow span are packed as narrow codes (False: as int8, the layout before them).
NARROW_CODES = True
_gemm = native.Function(
    "pagedserve_quant_gemm",
    [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 10 + [ctypes.c_int],
    {2: "native quantized GEMM: bits must be 4, 5, 6 or 8 (with a bias that keeps the values int8)",
     3: "native quantized GEMM: K must be whole groups, of whole words or chunks (8 k for 4 bits, 32 for 5, 16 for 6)",
     4: "native quantized GEMM: scale steps need whole super-blocks of groups"},
)
_int8_dots = native.Function("pagedserve_quant_gemm_int8_dots", [ctypes.c_int])
_int8_dots_built = native.Function("pagedserve_quant_gemv_i8_built", [ctypes.POINTER(ctypes.c_int)])
# How the tiles hold scales and offsets (ParamsKind in quant_gemm.cpp).
FLOAT32, FLOAT16, STEPS_TIMES_HALF = 0, 1, 2
# Below 64 tiles per thread, one call is cheaper than handing work to another thread.
_split = RangeSplitter("pagedserve-qgemm", min_per_thread=64)
_DTYPE_CODES = {torch.float32: native.dtype_code(torch.empty(0)),
                torch.bfloat16: native.dtype_code(torch.empty(0, dtype=torch.bfloat16))}


class NativePacked(NamedTuple):
    """The packed codes [tiles, K, 16] (int8), [tiles, K / 8, 16, 4] (int4 words) or [tiles, chunks, words + 1, 16,
    4] (5 and 6 bits: a chunk's int4 words, then its high word), per-tile scales/offsets [tiles, groups, 16] (fp32,
    fp16 or int8 steps) with, for steps, their fp16 per super-block [tiles, groups / per_super, 16], the codes'
    bits and bias (value = code + bias), and the kernel's per-weight arguments (pointers and sizes) worked out
    once."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    supers: tuple[torch.Tensor | None, torch.Tensor | None]  # scales', offsets' (STEPS_TIMES_HALF only)
    kind: int
    per_super: int
    bits: int
    bias: int
    weight_args: tuple[int, ...]  # q, scales, offsets, scale super, offset super pointers; n, k, group_size, bits,
    # kind, per_super, bias


def fits(weight: QuantizedWeight) -> bool:
    """True when the native kernel serves this layout (whole groups; int4 groups of whole words; int8 ones, held as
    narrow codes only where their groups are whole chunks) and it loads."""
    k, size = weight.in_features, weight.group_size
    whole = k % size == 0 and (weight.bits == 8 or size % 8 == 0)
    return whole and weight.device.type == "cpu" and native.load() is not None


def _tiles(t: torch.Tensor) -> torch.Tensor:  # [N, C] -> [tiles, C, 16], rows padded with zeros
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
    return t.view(-1, TILE, t.shape[1]).transpose(1, 2).contiguous()


def _params(scales: torch.Tensor, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both in fp16 when fp16 holds every value exactly (GGUF's own scales), else both in fp32."""
    both = [scales.float()] + ([] if offsets is None else [offsets.float()])
    half = all(torch.equal(t.half().float(), t) for t in both)
    tiled = [_tiles(t.half() if half else t) for t in both]
    return tiled[0], (tiled[1] if offsets is not None else None)


def code_bits(weight: QuantizedWeight, q: torch.Tensor) -> tuple[int, int]:
    """(bits, bias) of the codes the kernel holds `weight`'s integers `q` in: the fewest bits whose chunks its groups
    fill that hold every q - bias (bias: the least q), else 8 (int8, bias 0)."""
    if weight.bits == 4:
        return 4, 0
    low, high = (int(q.min()), int(q.max())) if q.numel() else (0, 0)
    for bits, chunk in CHUNK_K.items():
        if NARROW_CODES and high - low < 1 << bits and weight.group_size % chunk == 0:
            return bits, low
    return 8, 0


def pack(weight: QuantizedWeight) -> NativePacked:
    """The native layout of `weight` (call fits() first)."""
    q = weight.int_values()
    bits, bias = code_bits(weight, q)
    if bits == 8:
        packed = _tiles(q.to(torch.int8))
    elif bits == 4:
        packed = _int4_words((q - bias).to(torch.uint8))
    else:
        packed = _narrow_chunks((q - bias).to(torch.uint8), bits)
    factors = weight.factors
    if factors is not None:
        scales, offsets = _tiles(factors.scale_steps), _optional_tiles(factors.offset_steps)
        supers = (_tiles(factors.scale_super), _optional_tiles(factors.offset_super))
        kind, per_super = STEPS_TIMES_HALF, factors.per_super
    else:
        scales, offsets = _params(*weight.params())
        supers, kind, per_super = (None, None), int(scales.dtype == torch.float16), 1
    pointers = (packed, scales, offsets, *supers)
    args = (*(0 if t is None else t.data_ptr() for t in pointers), weight.out_features, weight.in_features,
            weight.group_size, bits, kind, per_super, bias)
    return NativePacked(packed, scales, offsets, supers, kind, per_super, bits, bias, args)


def _int4_words(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [tiles, K / 8, 16, 4] bytes: per tile, 8 k and 16 rows, each row's word little-endian
    with nibble i holding k0 + NIBBLE_K[i]."""
    nibbles = q.view(q.shape[0], -1, 8)[:, :, list(NIBBLE_K)]
    words = nibbles[:, :, 0::2] | (nibbles[:, :, 1::2] << 4)  # [N, K / 8, 4] bytes
    return _tiles(words.flatten(1)).view(-1, q.shape[1] // 8, 4, TILE).transpose(2, 3).contiguous()


def _narrow_chunks(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] codes below 2^bits -> [tiles, chunks, words + 1, 16, 4] bytes: per tile and chunk of CHUNK_K[bits] k,
    the low nibbles' int4 words, then one word per row holding each k's high bits at HIGH_BITS_AT[bits]."""
    n, k = codes.shape
    chunk = CHUNK_K[bits]
    words = _int4_words(codes & 15)  # [tiles, K / 8, 16, 4]
    words = words.view(words.shape[0], k // chunk, chunk // 8, TILE, 4)
    at = torch.tensor(HIGH_BITS_AT[bits], dtype=torch.int64)
    high = ((codes >> 4).to(torch.int64).view(n, k // chunk, chunk) << at).sum(-1)  # [N, chunks], bits disjoint
    high = torch.where(high >= 1 << 31, high - (1 << 32), high).to(torch.int32)  # the same 32 bits
    high = _tiles(high).view(torch.uint8).view(-1, k // chunk, 1, TILE, 4)
    return torch.cat([words, high], dim=2).contiguous()


def _optional_tiles(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _tiles(t)


def unpacker(packed: NativePacked, weight: QuantizedWeight):
    """The integers [rows, K] int32 read back from the packed tiles, only the rows asked for."""
    n, k = weight.out_features, weight.in_features

    def low_nibbles(words: torch.Tensor) -> torch.Tensor:  # [R, K / 8, 4] bytes -> [R, K] int32
        nibbles = torch.stack([words & 15, words >> 4], dim=-1).flatten(-2)  # [R, K / 8, 8] in nibble order
        return nibbles[:, :, list(_NIBBLE_OF_K)].reshape(words.shape[0], k).to(torch.int32)

    def unpack(rows: torch.Tensor | None) -> torch.Tensor:
        rows = torch.arange(n) if rows is None else rows.long()
        if packed.bits == 8:
            return packed.q[rows // TILE, :, rows % TILE].to(torch.int32)
        if packed.bits == 4:
            return low_nibbles(packed.q[rows // TILE, :, rows % TILE]) + packed.bias
        chunks = packed.q[rows // TILE, :, :, rows % TILE]  # [R, chunks, words + 1, 4] bytes
        low = low_nibbles(chunks[:, :, :-1].reshape(len(rows), -1, 4))
        high = chunks[:, :, -1].contiguous().view(torch.int32).to(torch.int64)  # [R, chunks, 1]
        at = torch.tensor(HIGH_BITS_AT[packed.bits], dtype=torch.int64)
        high = ((high >> at) & ((1 << (packed.bits - 4)) - 1)).reshape(len(rows), k)
        return (low | (high << 4).to(torch.int32)) + packed.bias

    return unpack


def params_unpacker(packed: NativePacked):
    """(scales, offsets or None) [rows, groups] read back from the packed tiles (in their fp16 or fp32), only the
    rows asked for."""
    n = packed.weight_args[5]

    def read(values: torch.Tensor | None, super_: torch.Tensor | None, tile: torch.Tensor,
             lane: torch.Tensor) -> torch.Tensor | None:
        if values is None:
            return None
        if packed.kind != STEPS_TIMES_HALF:
            return values[tile, :, lane]
        # fp16 times int8 steps, exact in fp32: the values an fp32 store would hold.
        return super_[tile, :, lane].float().repeat_interleave(packed.per_super, dim=-1) * values[tile, :, lane]

    def unpack(rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = torch.arange(n) if rows is None else rows.long()
        tile, lane = rows // TILE, rows % TILE
        return read(packed.scales, packed.supers[0], tile, lane), read(packed.offsets, packed.supers[1], tile, lane)

    return unpack


def set_int8_dots(on: bool) -> None:
    """Whether one activation row against int8 tiles runs quant_gemv_i8.cpp's exact integer dot products (VNNI;
    the default where the CPU has them) or the fp32 / bf16 path (off: for comparisons)."""
    if native.load() is not None:
        _int8_dots(int(on))


def int8_dots_built() -> bool:
    """True when the native library has the integer-dot path for one bf16 row against int8 tiles (the CPU has
    AVX-512 VNNI and VBMI)."""
    if native.load() is None:
        return False
    built = ctypes.c_int(0)
    _int8_dots_built(ctypes.byref(built))
    return bool(built.value)


def gemm(x: torch.Tensor, packed: NativePacked) -> torch.Tensor:
    """x [M, K] (fp32 or bf16, contiguous) @ W.T -> [M, N] in x's dtype, split over threads by tiles."""
    m, n = x.shape[0], packed.weight_args[5]
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return out
    tiles = packed.q.shape[0]
    code = _DTYPE_CODES[x.dtype]
    pointers, sizes = packed.weight_args[:5], packed.weight_args[5:]
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
    if tiles < 2 * _split.min_per_thread:  # one range (the splitter's own choice), without its call: ~120 a token
        _gemm(x_ptr, out_ptr, *pointers, m, *sizes, 0, tiles, code)
        return out

    def run(begin: int, end: int) -> None:
        _gemm(x_ptr, out_ptr, *pointers, m, *sizes, begin, end, code)

    _split(run, tiles)
    return out
