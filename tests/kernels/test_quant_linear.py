"""Weight-only quantized linear: the canonical layout, on-the-fly quantization, and each backend against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import quant_linear as ql
from pagedserve.kernels.quant_linear import cpu, layout, reference
from pagedserve.kernels.quant_linear.layout import QuantizedWeight
from tests.support.kernel_checks import compile_for_sm90

M_ROWS = [1, 7, 64]


@pytest.fixture
def torch_kernels(monkeypatch):
    """The CPU path without the native library: torch's packed kernels (the native one has its own tests)."""
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")


def _weight(n: int, k: int, bits: int, group_size: int, offsets: bool, seed: int = 0) -> QuantizedWeight:
    """Random integers, scales and offsets of the sizes real checkpoints have."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    low, high = (-128, 128) if bits == 8 else (0, 16)
    q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    offs = torch.randn(n, groups, generator=gen) * 0.05 if offsets else None
    return ql.from_int_values(q, scales, offs, bits, group_size)


@pytest.mark.parametrize("k", [1, 6, 33])
def test_int4_pack_then_unpack_gives_back_the_values_for_odd_widths(k):
    values = torch.randint(0, 16, (5, k), generator=torch.Generator().manual_seed(k))
    packed = ql.pack_int4(values)
    assert packed.shape == (5, (k + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(ql.unpack_int4(packed, k), values.to(torch.int32))
    assert packed[0, 0] == values[0, 0] | ((values[0, 1] if k > 1 else 0) << 4)


def test_dequantize_is_exactly_integers_times_scales_plus_offsets():
    q = torch.tensor([[0, 15, 7, 8, 1]])
    scales = torch.tensor([[0.5, 0.25, 2.0]], dtype=torch.float16)
    offsets = torch.tensor([[-4.0, 1.0, 0.5]], dtype=torch.float16)
    w = ql.from_int_values(q, scales, offsets, 4, group_size=2)  # the last group is one column
    assert w.dequantize().tolist() == [[-4.0, 3.5, 2.75, 3.0, 2.5]]
    q8 = ql.from_int_values(torch.tensor([[-128, 127, 3]]), torch.tensor([[0.125]]), None, 8, 3)
    assert q8.dequantize().tolist() == [[-16.0, 15.875, 0.375]]
    assert q8.dequantize(rows=torch.tensor([0, 0])).shape == (2, 3)


def test_fused_parts_with_different_groups_split_into_the_smallest_exactly():
    """GGUF Q4_K_M fuses Q4_K (int4, groups of 32, offsets) with Q6_K (int8, groups of 16, none) in one qkv."""
    q4 = _weight(8, 64, 4, 32, offsets=True, seed=1)
    q6 = _weight(5, 64, 8, 16, offsets=False, seed=2)
    fused = layout.concat_rows([q4, q6])
    assert (fused.bits, fused.group_size, fused.num_groups) == (8, 16, 4)
    assert torch.equal(fused.dequantize(), torch.cat([q4.dequantize(), q6.dequantize()]))
    assert torch.equal(layout.regroup(q4, 8).dequantize(), q4.dequantize())
    with pytest.raises(ValueError, match="same group size"):
        layout.concat_rows([_weight(4, 96, 4, 32, offsets=True), _weight(4, 96, 4, 48, offsets=True)])
    with pytest.raises(ValueError, match="same input width"):
        layout.concat_rows([q4, _weight(4, 96, 4, 32, offsets=True)])


def test_a_weight_of_the_wrong_shape_or_dtype_is_refused():
    with pytest.raises(ValueError, match="4-bit qweight must be"):
        QuantizedWeight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), None, 4, 8, 8)
    with pytest.raises(ValueError, match="scales must be"):
        QuantizedWeight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 2), None, 8, 8, 8)
    with pytest.raises(ValueError, match="even group_size"):
        QuantizedWeight(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 3), None, 4, 3, 8)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        QuantizedWeight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), None, 3, 8, 8)
    with pytest.raises(ValueError, match="0..15"):
        ql.pack_int4(torch.tensor([[16, 0]]))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_quantization_error_is_at_most_half_a_step(group_size, symmetric):
    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(group_size))  # 200: a partial last group
    q = ql.quantize_int4(w, group_size, symmetric=symmetric)
    step = q.scales.repeat_interleave(group_size, 1)[:, :200]
    # Symmetric clamps +absmax to 7 steps of absmax / 7: exact; -absmax never below -8 steps.
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert q.int_values().min() >= 0 and q.int_values().max() <= 15


def test_int8_per_channel_quantization_error_is_at_most_half_a_step():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    q = ql.quantize_int8(w)
    assert q.num_groups == 1 and q.offsets is None
    assert ((q.dequantize() - w).abs() <= q.scales / 2 + 1e-6).all()
    assert ql.quantize_int8(torch.zeros(2, 8)).dequantize().abs().max() == 0


def _bf16_emulation(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """What torch's CPU kernels compute: bf16 activations, scales and zeros, fp32 sums."""
    scales = w.scales.to(torch.bfloat16).float()
    rounded_w = w.int_values().float()
    if w.bits == 4:
        zeros = (w.offsets.float() + 8 * w.scales.float()).to(torch.bfloat16).float()
        rounded_w = rounded_w - 8
    else:
        zeros = w.offsets.float() if w.offsets is not None else torch.zeros_like(scales)
    per_col = lambda t: t.repeat_interleave(w.group_size, 1)[:, : w.in_features]  # noqa: E731
    dq = rounded_w * per_col(scales) + per_col(zeros)
    return x.to(torch.bfloat16).float() @ dq.T


@pytest.mark.parametrize("m", M_ROWS)
@pytest.mark.parametrize(("bits", "group_size", "offsets"),
                         [(8, 256, False), (8, 32, False), (8, 64, True), (4, 32, True), (4, 64, True),
                          (4, 128, True)])
def test_cpu_packed_kernel_equals_its_bf16_emulation_and_the_fp32_reference_to_bf16_rounding(m, bits, group_size,
                                                                                             offsets, torch_kernels):
    w = _weight(96, 256, bits, group_size, offsets)
    assert cpu.int4_fits(w) or cpu.int8_fits(w)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    out = cpu.quant_linear(x, w)
    assert out.dtype == torch.float32 and out.shape == (m, 96)
    emulated = _bf16_emulation(x, w)
    # The kernel rounds its output to bf16 (grouped int8: each group's partial sum), half a bf16 step each.
    roundings = w.num_groups if bits == 8 else 1
    atol = 2**-9 * roundings**0.5 * emulated.abs().max().item()
    torch.testing.assert_close(out, emulated, rtol=2**-8, atol=atol)
    exact = reference.quant_linear(x, w)
    torch.testing.assert_close(out, exact, rtol=0, atol=0.02 * exact.abs().max().item())


@pytest.mark.parametrize(("n", "k", "bits", "group_size"), [(97, 256, 4, 32), (96, 100, 4, 32), (96, 100, 8, 32)])
def test_cpu_layers_the_packed_kernels_do_not_serve_run_the_reference_exactly(n, k, bits, group_size, torch_kernels):
    w = _weight(n, k, bits, group_size, offsets=bits == 4)
    assert not (cpu.int4_fits(w) or cpu.int8_fits(w))
    x = torch.randn(7, k)
    assert torch.equal(cpu.quant_linear(x, w), reference.quant_linear(x, w))


def test_cpu_kernel_adds_bias_and_keeps_leading_dims_and_dtype():
    w = _weight(32, 64, 4, 32, offsets=True)
    bias = torch.randn(32, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = cpu.quant_linear(x, w, bias)
    assert out.shape == (2, 3, 32) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.quant_linear(x.float(), w, bias.float()), atol=0.05, rtol=0.02)


def test_prepare_builds_the_cpu_packed_form_once(torch_kernels):
    w = _weight(32, 64, 4, 32, offsets=True)
    extra = ql.prepare(w)
    assert extra == 32 * 32 + 2 * 32 * 2 * 2  # packed nibbles + bf16 (scale, zero) per group
    packed = w.packed["cpu_int4"]
    ql.quant_linear(torch.randn(1, 64), w)
    assert w.packed["cpu_int4"] is packed


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 128), (8, 32)])
def test_prepare_drops_the_canonical_integers_and_reads_them_back_exactly_through_the_packed_form(bits, group_size):
    w = _weight(48, 256, bits, group_size, offsets=True)
    q, dense = w.int_values(), w.dequantize()
    x = torch.randn(3, 256)
    before = cpu.quant_linear(x, w)
    ql.prepare(w)
    assert w.qweight is None and "qweight" not in w.tensors()
    assert torch.equal(w.int_values(), q) and torch.equal(w.dequantize(), dense)
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(w.dequantize(rows=rows), dense[rows])
    assert torch.equal(cpu.quant_linear(x, w), before)
    assert torch.equal(w.canonical_qweight(), ql.pack_int4(q) if bits == 4 else q.to(torch.int8))


def test_a_per_channel_int8_weight_is_served_from_its_own_tensor_and_kept(torch_kernels):
    w = _weight(32, 64, 8, 64, offsets=False)
    assert ql.prepare(w) == 32 * 2  # bf16 scales only
    assert w.qweight is not None


TRITON_CASES = [(8, 263, None), (8, 263, 32), (4, 97, 32), (4, 263, 128), (4, 97, 16), (8, 256, 16)]


@pytest.mark.parametrize("m", M_ROWS)
@pytest.mark.parametrize(("bits", "k", "group_size"), TRITON_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_dequantize_in_the_gemm_equals_the_reference(m, bits, k, group_size, dtype):
    from pagedserve.kernels.quant_linear import triton as quant_triton

    n = 37  # odd N, with odd K: masked tails on both
    w = _weight(n, k, bits, group_size or k, offsets=bits == 4 or group_size == 32, seed=k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n).to(dtype) if m == 7 else None
    got = quant_triton.quant_linear(x, w, bias)
    want = reference.quant_linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.float32:  # the same weights; only the order of the fp32 sums differs
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        return
    # bf16: the interpreter truncates each dequantized weight to bf16 where torch rounds (one bf16 step of each
    # product at most), and both round the output.
    bound = 2**-7 * (x.float().abs() @ w.dequantize().abs().T) + 2**-7 * want.float().abs() + 1e-3
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_triton_keeps_leading_dims_and_serves_an_empty_batch():
    from pagedserve.kernels.quant_linear import triton as quant_triton

    w = _weight(20, 64, 4, 32, offsets=True)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(quant_triton.quant_linear(x, w), reference.quant_linear(x, w), atol=1e-4, rtol=1e-5)
    assert quant_triton.quant_linear(torch.empty(0, 64), w).shape == (0, 20)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_on_the_triton_quantized_kernel_gives_the_reference_kernels_tokens(tiny_llama_path, monkeypatch,
                                                                                  method):
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.kernels.quant_linear import triton as quant_triton
    from tests.support.kernel_checks import spy

    prompts = [[5, 17, 33, 90, 41, 7, 250, 3, 64], [12, 8, 300, 77, 19, 45, 101, 6]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outputs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("PAGEDSERVE_KERNELS", mode)
        engine = LLMEngine.from_pretrained(str(tiny_llama_path), dtype="float32", device="cpu", num_blocks=16,
                                           quantization=method)
        launches = spy(monkeypatch, quant_triton, "quant_linear")
        outputs[mode] = engine.generate(prompts, params)
    assert launches, "the Triton quantized linear never ran"
    for got, want in zip(outputs["triton"], outputs["torch"], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        got_lp = [lp[t] for lp, t in zip(got.outputs[0].logprobs, got.outputs[0].token_ids, strict=True)]
        want_lp = [lp[t] for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids, strict=True)]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)


_AOT_SCRIPT = """
import json, torch
from pagedserve.kernels import quant_linear as ql
from pagedserve.kernels.quant_linear import triton as quant_triton
from pagedserve.kernels.aot import compile_launch, record_launches

# GGUF Q6_K's form too: int8 in groups of 16 with fp32 scales (a K tile spans two groups).
q6_k = ql.from_int_values(torch.zeros(4096, 4096, dtype=torch.int32), torch.ones(4096, 256), None, 8, 16)
weights = [ql.quantize_int4(torch.zeros(4096, 4096), 128), ql.quantize_int8(torch.zeros(4096, 4096)), q6_k]
with record_launches(quant_triton) as launches:
    for w in weights:
        for m in (1, 512):  # the decode tile and the prefill tile
            quant_triton.quant_linear(torch.zeros(m, 4096, dtype=torch.bfloat16), w)
print(json.dumps([compile_launch(launch) for launch in launches]))
"""


def test_the_quantized_gemm_compiles_for_sm90_without_spills():

    # A fresh interpreter: here the kernels were decorated for TRITON_INTERPRET and cannot compile.
    configs = compile_for_sm90(_AOT_SCRIPT)
    assert [(c["constexprs"]["BITS"], c["constexprs"]["GROUP"], c["constexprs"]["BLOCK_M"]) for c in configs] == [
        (4, 128, 16), (4, 128, 64), (8, 4096, 16), (8, 4096, 64), (8, 16, 16), (8, 16, 64)]
    for config in configs:
        assert config["stack_bytes"] == 0, config  # no register spills
        assert config["shared_bytes"] <= 232448, config  # 227 KB per block on sm_90
