"""Every GGUF block format pagedserve serves unpacks to exactly what gguf's own dequantizer gives, on random blocks:
the integers, scales and offsets it keeps reproduce each stored value bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve.backend.model import gguf_blocks
from pagedserve.kernels import native
from pagedserve.kernels import quant_linear as ql
from tests.support import tiny_gguf


def random_blocks(kind: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    return tiny_gguf.random_blocks(kind, rows, blocks_per_row * gguf_blocks.FORMATS[kind][0], seed)


def test_the_formats_table_agrees_with_ggml_s_block_sizes():
    for kind, (values, size, _) in gguf_blocks.FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)] == (values, size)


@pytest.mark.parametrize("kind", list(gguf_blocks.FORMATS))
def test_unpacked_blocks_dequantize_bit_for_bit_as_gguf_does(kind):
    values = gguf_blocks.FORMATS[kind][0]
    rows, per_row = 7, 3
    raw = random_blocks(kind, rows, per_row, seed=len(kind) * 31 + values)
    weight = gguf_blocks.unpack_blocks(kind, torch.from_numpy(raw), rows, per_row * values)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    got = weight.dequantize().numpy()
    assert got.shape == want.shape == (rows, per_row * values)
    if kind == "Q4_0":  # kept as q * d - 8d (int4 with offsets): (q - 8) * d's zeros may differ in sign only
        assert np.array_equal(got, want)
    else:
        assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize(("kind", "bits", "group_size", "offsets"), [
    ("Q2_K", 4, 16, True), ("Q3_K", 8, 16, False), ("Q4_K", 4, 32, True), ("Q5_K", 8, 32, True),
    ("Q6_K", 8, 16, False), ("IQ4_NL", 8, 32, False), ("IQ4_XS", 8, 32, False), ("Q5_0", 8, 32, False),
    ("Q5_1", 8, 32, True)])
def test_each_format_keeps_its_sub_blocks_as_groups_and_its_integers_in_the_narrowest_layout(kind, bits, group_size,
                                                                                             offsets):
    values = gguf_blocks.FORMATS[kind][0]
    raw = random_blocks(kind, 2, 256 // values, seed=1)
    weight = gguf_blocks.unpack_blocks(kind, torch.from_numpy(raw), 2, 256)
    assert (weight.bits, weight.group_size, weight.offsets is not None) == (bits, group_size, offsets)
    assert weight.scales.dtype in (torch.float16, torch.float32)


def test_q6_k_integers_and_scales_are_the_stored_ones():
    """One hand-built Q6_K block: value i of sub-block s is d * scale[s] * (q[i] - 32)."""
    q = np.arange(256) % 64
    scales = (np.arange(16) - 8).astype(np.int8)
    ql = np.zeros(128, np.uint8)
    qh = np.zeros(64, np.uint8)
    for i, v in enumerate(q):  # ggml's order: halves of 128, low nibbles of 64-byte runs, 2-bit highs of 32
        half, j = divmod(i, 128)
        ql[half * 64 + j % 64] |= (v & 15) << (4 * (j // 64))
        qh[half * 32 + j % 32] |= (v >> 4) << (2 * (j // 32))
    raw = np.concatenate([ql, qh, scales.view(np.uint8), np.array([0.5], np.float16).view(np.uint8)])[None]
    weight = gguf_blocks.unpack_blocks("Q6_K", torch.from_numpy(raw), 1, 256)
    assert torch.equal(weight.int_values()[0], torch.from_numpy(q - 32).to(torch.int32))
    assert torch.equal(weight.scales[0], torch.from_numpy(0.5 * scales.astype(np.float32)))


def test_data_that_does_not_fill_the_shape_is_refused():
    raw = random_blocks("Q4_K", 2, 1, seed=0)
    with pytest.raises(ValueError, match=r"does not hold \[3, 256\]"):
        gguf_blocks.unpack_blocks("Q4_K", torch.from_numpy(raw), 3, 256)


@pytest.mark.skipif(native.load() is None, reason="no native CPU kernels (no compiler)")
# Q4_K: 4-bit integers, an int8 scale and min step per 32 and two fp16 per 256 (the file: 4.5); Q6_K: 6-bit codes,
# an int8 step per 16 and an fp16 per 256 (as the file); Q8_0: int8 and an fp16 per 32, as the file; Q5_0: 5-bit
# codes and an fp16 per 32 (as the file); Q5_K: 5-bit codes with Q4_K's scales (the file: 5.5); Q3_K: int4 codes
# (its -4..3) and an int8 step per 16 (the file: 3.4375).
@pytest.mark.parametrize(("kind", "bits_per_weight"), [("Q4_K", 4.625), ("Q6_K", 6.5625), ("Q8_0", 8.5),
                                                       ("Q2_K", 5.125), ("IQ4_XS", 8.3125), ("Q5_0", 5.5),
                                                       ("Q5_K", 5.625), ("Q3_K", 4.5625)])
def test_a_prepared_weight_is_held_once_in_the_native_form(kind, bits_per_weight):
    """Integers, scales and offsets live only in the native GEMM's tiles once prepared (the K-quants' scales as
    their int8 steps times an fp16 per super-block, Q8_0's d as fp16), and still dequantize exactly."""
    raw = random_blocks(kind, 64, 1024 // gguf_blocks.FORMATS[kind][0], seed=3)
    weight = gguf_blocks.unpack_blocks(kind, torch.from_numpy(raw), 64, 1024)
    dense = weight.dequantize()
    ql.prepare(weight)
    assert (weight.nbytes() + weight.packed_nbytes()) * 8 / (64 * 1024) == bits_per_weight
    assert torch.equal(weight.dequantize(), dense)
    assert torch.equal(weight.dequantize(rows=torch.tensor([63, 0, 17])), dense[[63, 0, 17]])
    for m in (1, 5, 9):  # the native GEMM on the factored scales: the exact product to fp32 rounding
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m))
        exact = x.double() @ dense.double().T
        terms = (x.double().abs() @ dense.double().abs().T).max().item()
        assert (ql.quant_linear(x, weight).double() - exact).abs().max().item() <= 1024**0.5 * 2**-24 * terms
        xb = x.bfloat16()  # bf16 activations: summed in fp32, rounded once to bf16
        exact = xb.double() @ dense.double().T
        assert ((ql.quant_linear(xb, weight).double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
