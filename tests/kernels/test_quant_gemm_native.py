"""The native weight-only quantized GEMM (quant_gemm.cpp) against the fp32 reference, and its packed form."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import native
from pagedserve.kernels import quant_linear as ql
from pagedserve.kernels.quant_linear import cpu, native_gemm, reference
from pagedserve.kernels.quant_linear.layout import QuantizedWeight

pytestmark = pytest.mark.skipif(native.load() is None, reason="no native CPU kernels (no compiler)")

# (bits, group_size or None for one per channel, offsets)
# Groups of 16: GGUF's Q6_K / Q3_K (int8, no offsets) and Q2_K (int4 with offsets) sub-blocks.
LAYOUTS = [(8, 32, False), (8, None, False), (8, 32, True), (4, 32, True), (4, 32, False), (4, 128, True),
           (4, 128, False), (8, 16, False), (8, 16, True), (4, 16, True)]


def _weight(n: int, k: int, bits: int, group_size: int | None, offsets: bool, half: bool,
            seed: int = 0) -> QuantizedWeight:
    """Random integers; fp16 scales and offsets (GGUF's, held as fp16 by the kernel) or fp32 ones (held as fp32)."""
    gen = torch.Generator().manual_seed(seed)
    group_size = group_size or k
    low, high = (-128, 128) if bits == 8 else (0, 16)
    q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.001
    scales[0, 0] = -(2.0**-20)  # an fp16 subnormal, negative
    offs = torch.randn(n, k // group_size, generator=gen) * 0.05 if offsets else None
    if half:
        scales, offs = scales.half(), None if offs is None else offs.half()
    return ql.from_int_values(q, scales, offs, bits, group_size)


def _exact(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The dequantized weight's product in fp64: the truth both fp32 paths round."""
    return x.double() @ w.dequantize(torch.float64).T


@pytest.mark.parametrize("m", [1, 3, 8, 11])
@pytest.mark.parametrize(("bits", "group_size", "offsets"), LAYOUTS)
@pytest.mark.parametrize("half", [True, False])
def test_native_gemm_equals_the_fp32_reference_to_fp32_rounding(m, bits, group_size, offsets, half):
    w = _weight(37, 256, bits, group_size, offsets, half, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    out = cpu.quant_linear(x, w)
    assert "cpu_native" in w.packed and out.dtype == torch.float32 and out.shape == (m, 37)
    assert (native_gemm.pack(w).scales.dtype == torch.float16) == half
    exact = _exact(x, w)
    # Each of the ~K products rounds once in fp32: the error grows like sqrt(K) fp32 steps of the terms.
    terms = (x.double().abs() @ w.dequantize(torch.float64).abs().T).max().item()
    tolerance = 256**0.5 * 2**-24 * terms
    assert (out.double() - exact).abs().max().item() <= tolerance
    assert (reference.quant_linear(x, w).double() - exact).abs().max().item() <= tolerance


@pytest.mark.parametrize(("bits", "group_size", "offsets"), LAYOUTS)
def test_bf16_activations_are_summed_in_fp32_and_rounded_once(bits, group_size, offsets):
    w = _weight(37, 256, bits, group_size, offsets, half=True)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = cpu.quant_linear(x, w)
    assert out.dtype == torch.bfloat16
    exact = _exact(x, w)  # the bf16 inputs exactly, the weight unrounded (the reference rounds it to bf16)
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    rounded_weight = reference.quant_linear(x, w).double()
    assert (rounded_weight - exact).abs().max() > (out.double() - exact).abs().max()


@pytest.mark.parametrize("m", [1, 2, 3, 5])  # int4 takes the bf16 dot products at every row count
@pytest.mark.parametrize(("bits", "group_size", "offsets"), [x for x in LAYOUTS if x[0] == 4])
def test_int4_bf16_activations_at_few_rows_round_the_fp32_sums_once(bits, group_size, offsets, m):
    w = _weight(37, 256, bits, group_size, offsets, half=True, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    out = cpu.quant_linear(x, w).double()
    exact = _exact(x, w)
    assert ((out - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    # The fp32 path on the same (bf16-exact) inputs, rounded once to bf16: the sums differ only in their order.
    fp32 = cpu.quant_linear(x.float(), w).bfloat16().double()
    assert ((out - fp32).abs() <= fp32.abs() * 2**-7 + 1e-6).all()


def test_leading_dims_bias_and_an_empty_batch():
    w = _weight(40, 64, 4, 32, True, half=True)
    bias = torch.randn(40)
    x = torch.randn(2, 3, 64)
    out = cpu.quant_linear(x, w, bias)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, reference.quant_linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert cpu.quant_linear(torch.randn(0, 64), w).shape == (0, 40)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 32), (8, None)])
def test_prepare_keeps_the_weight_once_and_gives_its_integers_and_scales_back_exactly(bits, group_size):
    w = _weight(37, 128, bits, group_size, offsets=bits == 4, half=True)
    q, dense, (scales, offsets) = w.int_values(), w.dequantize(), w.params()
    x = torch.randn(3, 128)
    before = cpu.quant_linear(x, w)
    extra = ql.prepare(w)
    assert w.qweight is None and w.scales is None and w.tensors() == {} and w.nbytes() == 0
    got_scales, got_offsets = w.params(torch.tensor([36, 2]))
    assert torch.equal(got_scales.float(), scales[[36, 2]].float())
    assert (got_offsets is None) == (offsets is None) and w.has_offsets == (offsets is not None)
    if offsets is not None:
        assert torch.equal(got_offsets.float(), offsets[[36, 2]].float())
    tiles, groups = 3, 128 // (group_size or 128)  # 37 rows pad to 3 tiles of 16
    per_row = 128 if bits == 8 else 64
    assert extra == tiles * 16 * (per_row + groups * 2 * (2 if bits == 4 else 1))
    assert torch.equal(w.int_values(), q) and torch.equal(w.dequantize(), dense)
    rows = torch.tensor([36, 0, 17, 36])
    assert torch.equal(w.dequantize(rows=rows), dense[rows])
    assert torch.equal(cpu.quant_linear(x, w), before)


def test_threads_split_the_tiles_and_give_one_thread_s_result():
    w = _weight(16 * 130 + 5, 64, 8, 32, offsets=False, half=True)
    x = torch.randn(2, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.quant_linear(x, w)
        torch.set_num_threads(2)
        assert torch.equal(cpu.quant_linear(x, w), one)
    finally:
        torch.set_num_threads(threads)


def test_layouts_it_does_not_serve_fall_back():
    w = _weight(16, 96, 4, 32, True, half=True)
    w3 = ql.from_int_values(w.int_values()[:, :90], w.scales, w.offsets, 4, 32)  # K not whole groups
    assert not native_gemm.fits(w3)
    x = torch.randn(2, 90)
    assert torch.equal(cpu.quant_linear(x, w3), reference.quant_linear(x, w3))


def test_int4_words_hold_each_row_s_eight_k_in_nibble_order():
    k = torch.arange(64)
    q = ((k[None, :] + 3 * torch.arange(20)[:, None]) % 16).to(torch.int32)  # row r, column k: (k + 3r) % 16
    w = ql.from_int_values(q, torch.ones(20, 2).half(), None, 4, 32)
    words = native_gemm.pack(w).q  # [tiles, K / 8, 16, 4] bytes
    assert tuple(words.shape) == (2, 8, 16, 4)
    row, chunk = 5, 3
    word = int.from_bytes(bytes(words[0, chunk, row].tolist()), "little")
    nibbles = [(word >> (4 * i)) & 15 for i in range(8)]
    assert nibbles == [(chunk * 8 + native_gemm.NIBBLE_K[i] + 3 * row) % 16 for i in range(8)]
    assert torch.equal(native_gemm.unpacker(native_gemm.pack(w), w)(None), q)


def test_int4_groups_that_are_not_whole_words_fall_back():
    w = _weight(16, 96, 4, 32, True, half=True)
    w4 = ql.from_int_values(w.int_values(), w.scales.repeat_interleave(8, dim=1), w.offsets.repeat_interleave(8, dim=1),
                            4, 4)  # groups of 4 values: half a word
    assert not native_gemm.fits(w4)
    x = torch.randn(2, 96)
    torch.testing.assert_close(cpu.quant_linear(x, w4), reference.quant_linear(x, w4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("group_size", "offsets", "half"), [(32, False, True), (None, False, False), (16, True, True),
                                                             (32, True, False)])
def test_one_bf16_row_against_int8_tiles_is_the_exact_product_rounded_once(group_size, offsets, half):
    w = _weight(37, 256, 8, group_size, offsets, half, seed=3)
    gen = torch.Generator().manual_seed(3)
    for x in (torch.randn(1, 256, generator=gen), torch.randn(1, 256, generator=gen) * 2.0 ** torch.randint(
            -20, 20, (1, 256), generator=gen)):  # a spread of exponents too wide for the digits: the fp32 path
        x = x.bfloat16()
        out = cpu.quant_linear(x, w).double()
        exact = _exact(x, w)
        assert ((out - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
        native_gemm.set_int8_dots(False)
        try:
            other = cpu.quant_linear(x, w).double()
        finally:
            native_gemm.set_int8_dots(True)
        assert ((out - other).abs() <= other.abs() * 2**-7 + 1e-6).all()


@pytest.mark.skipif(not native_gemm.int8_dots_built(), reason="no AVX-512 VNNI / VBMI")
@pytest.mark.parametrize(("group_size", "low", "bits", "dtype"), [
    (32, -128, 8, torch.bfloat16), (None, -128, 8, torch.bfloat16), (32, -16, 5, torch.bfloat16),
    (32, 3, 5, torch.float32), (32, -32, 6, torch.bfloat16), (16, -40, 6, torch.float32), (None, -32, 6, torch.float32),
    (32, -8, 4, torch.bfloat16), (16, 0, 4, torch.bfloat16)])
def test_integer_dots_sum_a_group_exactly_where_fp32_sums_lose_it(group_size, low, bits, dtype):
    # 2^24 + 1 - 2^24: summed in fp32 the 1 is lost; the integer digits keep it. The other k's integers span
    # 2^bits values from `low` (so the weight is held as codes of that many bits, q - low) and meet zeros.
    q = torch.randint(low, low + 2**bits, (16, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    q[:, 3] = low + 2**bits - 1
    q[:, :3] = torch.tensor([1, 1, 1]) if low <= 1 < low + 2**bits else torch.tensor([low, low, low])
    w = ql.from_int_values(q, torch.ones(16, 64 // (group_size or 64)).half(), None, 8, group_size or 64)
    assert native_gemm.pack(w).bits == bits and native_gemm.pack(w).bias == (0 if bits == 8 else low)
    x = torch.zeros(1, 64, dtype=dtype)
    x[0, :3] = torch.tensor([2.0**24, 1.0, -(2.0**24)])
    assert torch.equal(cpu.quant_linear(x, w), q[:, 1].to(dtype).view(1, 16))
    if bits != 8:
        return
    native_gemm.set_int8_dots(False)
    try:
        assert torch.equal(cpu.quant_linear(x, w), torch.zeros(1, 16, dtype=torch.bfloat16))
    finally:
        native_gemm.set_int8_dots(True)
