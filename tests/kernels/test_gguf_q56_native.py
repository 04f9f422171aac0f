"""GGUF's 5- and 6-bit formats (Q5_0, Q5_1, Q5_K, Q6_K; Q3_K too) in the native GEMM's narrow codes: held as 4-, 5-
or 6-bit codes, they give gguf's own dequantized weights back bit for bit and the product of those weights to fp32
rounding, at one activation row and many, fp32 and bf16, on the AVX-512 build and on an AVX2 one."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedserve.backend.model import gguf_blocks
from pagedserve.kernels import native
from pagedserve.kernels import quant_linear as ql
from pagedserve.kernels.quant_linear import native_gemm
from tests.support import tiny_gguf

pytestmark = pytest.mark.skipif(native.load() is None, reason="no native CPU kernels (no compiler)")

# kind -> the code bits it is held in (Q3_K's integers -4..3 fit int4 words with a bias)
CODE_BITS = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q3_K": 4}
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "llamacpp"


def _weight(kind: str, rows: int, cols: int, seed: int) -> tuple[ql.QuantizedWeight, np.ndarray]:
    raw = tiny_gguf.random_blocks(kind, rows, cols, seed)
    return gguf_blocks.unpack_blocks(kind, torch.from_numpy(raw), rows, cols), raw


def _gguf_dense(kind: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).copy())


def _assert_product_to_fp32_rounding(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    exact = x.double() @ dense.double().T
    if x.dtype == torch.bfloat16:  # summed in fp32, rounded once to bf16
        assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
        return
    terms = (x.double().abs() @ dense.double().abs().T).max().item()
    assert (out.double() - exact).abs().max().item() <= x.shape[1] ** 0.5 * 2**-24 * terms


@pytest.mark.parametrize("kind", list(CODE_BITS))
@pytest.mark.parametrize(("rows", "cols"), [(37, 512), (16, 256), (5, 768)])
def test_narrow_codes_give_gguf_s_weights_back_and_their_product(kind, rows, cols):
    weight, raw = _weight(kind, rows, cols, seed=rows + cols)
    dense = _gguf_dense(kind, raw)
    packed = native_gemm.pack(weight)
    assert packed.bits == CODE_BITS[kind]
    ql.prepare(weight)
    assert weight.qweight is None and torch.equal(weight.dequantize().view(torch.int32), dense.view(torch.int32))
    picked = torch.tensor([rows - 1, 0, rows // 2])
    assert torch.equal(weight.dequantize(rows=picked), dense[picked])
    for m in (1, 2, 3, 8, 11, 20):  # one row, the few-row passes and the many-row path (int8 per tile)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).to(dtype)
            out = ql.quant_linear(x, weight)
            assert out.dtype == dtype and out.shape == (m, rows)
            _assert_product_to_fp32_rounding(out, x, dense)


@pytest.mark.parametrize("kind", ["Q5_0", "Q6_K"])
def test_narrow_codes_take_fewer_bytes_than_int8(kind):
    weight, _ = _weight(kind, 64, 1024, seed=2)
    wide = gguf_blocks.unpack_blocks(kind, torch.from_numpy(tiny_gguf.random_blocks(kind, 64, 1024, 2)), 64, 1024)
    narrow_bytes = native_gemm.pack(weight).q.numel()
    try:
        native_gemm.NARROW_CODES = False
        int8 = native_gemm.pack(wide)
    finally:
        native_gemm.NARROW_CODES = True
    assert int8.bits == 8 and narrow_bytes * 8 == int8.q.numel() * CODE_BITS[kind]


@pytest.mark.parametrize(("low", "high", "group_size", "bits"), [
    (-16, 15, 32, 5), (0, 31, 32, 5), (-32, 31, 16, 6), (-16, 15, 16, 6), (-4, 3, 16, 4), (3, 60, 32, 6),
    (-128, 127, 32, 8), (-20, 20, 16, 6), (-40, 40, 16, 8)])
def test_the_code_bits_are_the_fewest_whose_chunks_the_groups_fill(low, high, group_size, bits):
    """5-bit chunks are 32 k, 6-bit ones 16: a 32-value span in groups of 16 takes 6 bits; wider spans stay int8."""
    gen = torch.Generator().manual_seed(high)
    q = torch.randint(low, high + 1, (21, 128), generator=gen)
    q[0, :2] = torch.tensor([low, high])
    weight = ql.from_int_values(q, torch.rand(21, 128 // group_size, generator=gen).half(), None, 8, group_size)
    packed = native_gemm.pack(weight)
    assert (packed.bits, packed.bias) == (bits, low if bits < 8 else 0)
    assert torch.equal(native_gemm.unpacker(packed, weight)(None), q.to(torch.int32))
    x = torch.randn(3, 128, generator=gen)
    _assert_product_to_fp32_rounding(ql.quant_linear(x, weight), x, weight.dequantize())


def test_high_bits_sit_where_the_kernel_reads_them():
    """A 6-bit code's high bits at HIGH_BITS_AT of its chunk's high word; its low nibble in the int4 words."""
    codes = (torch.arange(16)[None, :] * 4 + torch.arange(16)[:, None]) % 64  # row r, k: (4k + r) % 64
    weight = ql.from_int_values(codes - 32, torch.ones(16, 1).half(), None, 8, 16)
    packed = native_gemm.pack(weight)
    assert tuple(packed.q.shape) == (1, 1, 3, 16, 4) and packed.bias == -32
    row = 5
    high = int.from_bytes(bytes(packed.q[0, 0, 2, row].tolist()), "little")
    assert [(high >> at) & 3 for at in native_gemm.HIGH_BITS_AT[6]] == (codes[row] >> 4).tolist()
    word = int.from_bytes(bytes(packed.q[0, 0, 1, row].tolist()), "little")  # k 8..15
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [int(codes[row, 8 + k]) & 15 for k in native_gemm.NIBBLE_K]


@pytest.mark.parametrize("name", ["tiny-llama.Q6_K.gguf", "tiny-llama.Q5_K_S.gguf", "tiny-llama.Q4_K_M.gguf"])
def test_llama_quantize_s_tensors_in_narrow_codes_are_its_own_values(name):
    reader = gguf.GGUFReader(FIXTURES / name)
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in CODE_BITS:
            continue
        cols, rows = (int(d) for d in tensor.shape[:2])
        raw = np.asarray(tensor.data).reshape(rows, -1)
        weight = gguf_blocks.unpack_blocks(kind, torch.from_numpy(raw.copy()).flatten(), rows, cols)
        bits = native_gemm.pack(weight).bits
        assert bits <= CODE_BITS[kind], (tensor.name, kind, bits)
        seen.add(kind)
        ql.prepare(weight)
        dense = _gguf_dense(kind, raw)
        assert torch.equal(weight.dequantize().view(torch.int32), dense.view(torch.int32)), tensor.name
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(rows))
        _assert_product_to_fp32_rounding(ql.quant_linear(x, weight), x, dense)
    assert seen & {"Q5_K", "Q6_K", "Q5_0", "Q5_1"}


@pytest.fixture(scope="module")
def avx2_gemm(tmp_path_factory):
    """quant_gemm.cpp (with quant_gemv_i8.cpp, which has no AVX2 path and declines every call) built for AVX2
    (x86-64-v3) alone: its portable vector code, not the AVX-512 paths."""
    compiler = native._compiler()
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip("no C++ compiler")
    kernels = Path(native.__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("avx2") / "quant_gemm_avx2.so"
    flags = [f for f in native.FLAGS if f != "-march=native"] + ["-march=x86-64-v3"]
    sources = [str(kernels / "quant_linear" / name) for name in ("quant_gemm.cpp", "quant_gemv_i8.cpp")]
    result = subprocess.run([compiler, *flags, *sources, "-o", str(out)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"no AVX2 build: {result.stderr[-300:]}")
    function = ctypes.CDLL(str(out)).pagedserve_quant_gemm
    function.restype, function.argtypes = ctypes.c_int, native_gemm._gemm._argtypes
    return function


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")),
                    reason="an x86-64 CPU with AVX2 runs the AVX2 build")
@pytest.mark.parametrize("kind", list(CODE_BITS))
def test_the_avx2_build_gives_the_same_product(kind, avx2_gemm):
    weight, raw = _weight(kind, 37, 512, seed=9)
    dense = _gguf_dense(kind, raw)
    packed = native_gemm.pack(weight)
    for m in (1, 3, 11):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
            out = torch.empty(m, 37, dtype=dtype)
            status = avx2_gemm(x.data_ptr(), out.data_ptr(), *packed.weight_args[:5], m, *packed.weight_args[5:], 0,
                               packed.q.shape[0], native_gemm._DTYPE_CODES[dtype])
            assert status == 0
            _assert_product_to_fp32_rounding(out, x, dense)
