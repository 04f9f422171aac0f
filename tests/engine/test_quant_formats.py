"""GPTQ, AWQ and compressed-tensors checkpoints: tensors packed by the test from known integers, zeros and scales
unpack to exactly (q - zero) * scale; a tiny model saved in each format serves like its dequantized fp32 twin;
unsupported configs are refused naming what is unsupported."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model.quant_formats import QuantFormatError, Scheme, scheme_from_config
from pagedserve.backend.model.quantized import QuantizedLinear, weight_bytes
from safetensors.torch import load_file, save_file

from tests.support.engines import cpu_engine

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


def _known(n: int, k: int, bits: int, group: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 1 << bits, (n, k))
    zeros = rng.integers(0, 1 << bits, (n, k // group))
    scales = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float16)
    dense = (q - np.repeat(zeros, group, 1)).astype(np.float32) * np.repeat(scales.astype(np.float32), group, 1)
    return q, zeros, scales, dense


def _gptq_parts(q, zeros, scales, bits, v2=False):
    stored = zeros if v2 else (zeros - 1) & ((1 << bits) - 1)  # v1 stores zero - 1 (0 wraps to 2^bits - 1)
    return {"qweight": pack(q.T, bits, 0), "qzeros": pack(stored.T, bits, 1),
            "scales": torch.from_numpy(scales.T.copy())}


def _awq_parts(q, zeros, scales):
    return {"qweight": awq_pack(q.T), "qzeros": awq_pack(zeros.T), "scales": torch.from_numpy(scales.T.copy())}


def _ct_parts(q, zeros, scales, bits, symmetric):
    """q and zeros here are unsigned: compressed-tensors' signed values and zero points + 2^(bits-1)."""
    parts = {"weight_packed": pack(q, bits, 1), "weight_scale": torch.from_numpy(scales.copy()),
             "weight_shape": torch.tensor(q.shape)}
    if not symmetric:
        parts["weight_zero_point"] = pack(zeros, bits, 0)
    return parts


def _parts(method, q, zeros, scales, bits, symmetric=False):
    """One projection's tensors in `method`'s format ("gptq_v2": GPTQ storing the zeros themselves)."""
    if method in ("gptq", "gptq_v2"):
        return _gptq_parts(q, zeros, scales, bits, v2=method == "gptq_v2")
    if method == "awq":
        return _awq_parts(q, zeros, scales)
    return _ct_parts(q, zeros, scales, bits, symmetric)


CASES = [("gptq", 4, 32, False), ("gptq", 8, 64, False), ("gptq_v2", 4, 128, False), ("gptq", 4, 32, True),
         ("awq", 4, 32, False), ("compressed-tensors", 4, 32, True), ("compressed-tensors", 4, 64, False),
         ("compressed-tensors", 8, 32, True)]


@pytest.mark.parametrize(("method", "bits", "group", "symmetric"), CASES)
def test_packed_projection_unpacks_to_exactly_q_minus_zero_times_scale(method, bits, group, symmetric):
    n, k = 24, 256
    q, zeros, scales, _ = _known(n, k, bits, group, seed=bits * group)
    if symmetric:
        zeros = np.full_like(zeros, 1 << (bits - 1))
    parts = _parts(method, q, zeros, scales, bits, symmetric)
    scheme = Scheme(method.replace("_v2", ""), bits, group, symmetric, zeros_minus_one=method == "gptq")
    weight = scheme.to_weight(parts, "layers.0.mlp.up_proj")
    assert (weight.bits, weight.group_size, weight.out_features, weight.in_features) == (bits, group, n, k)
    dense = (q - np.repeat(zeros, group, 1)).astype(np.float32) * np.repeat(scales.astype(np.float32), group, 1)
    assert np.array_equal(weight.dequantize().numpy(), dense)


@pytest.mark.parametrize(("config", "message"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int"}, "input_activations": {"num_bits": 8}}}}, "weight-only"),
])
def test_unsupported_quantization_configs_are_refused_naming_what(config, message):
    with pytest.raises(QuantFormatError, match=message):
        scheme_from_config({"quantization_config": config})


def test_a_non_contiguous_g_idx_is_refused():
    q, zeros, scales, _ = _known(8, 64, 4, 32, seed=1)
    parts = {**_gptq_parts(q, zeros, scales, 4), "g_idx": torch.arange(64) % 2}
    with pytest.raises(QuantFormatError, match="g_idx is not contiguous"):
        Scheme("gptq", 4, 32, False, True).to_weight(parts, "x")


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w: torch.Tensor, bits: int, group: int):
    """Asymmetric round-to-nearest with integer zeros, as GPTQ/AWQ store them: q, zeros, fp16 scales."""
    g = w.float().view(w.shape[0], -1, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / ((1 << bits) - 1)).clamp(min=1e-6).to(torch.float16)
    zeros = torch.round(-lo / scales.float()).clamp(0, (1 << bits) - 1)
    q = (torch.round(g / scales.float()[..., None]) + zeros[..., None]).clamp(0, (1 << bits) - 1)
    return q.flatten(1).int().numpy(), zeros.int().numpy(), scales.numpy()


def _write_checkpoint(source, target, method, bits, group):
    """The tiny model with its projections in `method`'s format, and its dequantized twin at target.ref."""
    shutil.copytree(source, target)
    shutil.copytree(source, target.with_suffix(".ref"))
    tensors, twin = load_file(str(source / "model.safetensors")), {}
    out = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rsplit(".", 1)[-1] not in PROJECTIONS or leaf != "weight":
            out[name] = twin[name] = tensor
            continue
        q, zeros, scales = _quantize(tensor, bits, group)
        parts = _parts(method, q, zeros, scales, bits)
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


@pytest.mark.parametrize(("method", "bits"), [("gptq", 4), ("gptq", 8), ("awq", 4), ("compressed-tensors", 4)])
def test_a_quantized_checkpoint_serves_like_its_dequantized_twin(tiny_llama_path, tmp_path, method, bits):
    path = _write_checkpoint(tiny_llama_path, tmp_path / "model", method, bits, 32)
    engine = cpu_engine(path, num_blocks=64, block_size=4)
    twin = cpu_engine(path.with_suffix(".ref"), num_blocks=64, block_size=4)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * engine.runner.arch.num_layers and {m.weight.bits for m in layers} == {bits}
    ref = load_file(str(path.with_suffix(".ref") / "model.safetensors"))
    qkv = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(engine.runner.model.layers[1].self_attn.qkv_proj.weight.dequantize(), qkv)
    assert weight_bytes(engine.runner.model) < weight_bytes(twin.runner.model)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for prompt in prompts:
        got = engine.generate([prompt], params)[0].prompt_logprobs
        want = twin.generate([prompt], params)[0].prompt_logprobs
        assert max(abs(a[t] - b[t]) for a, b, t in zip(got[1:], want[1:], prompt[1:], strict=True)) < 0.1


def test_on_the_fly_quantization_of_a_quantized_checkpoint_is_refused(tiny_llama_path, tmp_path):
    path = _write_checkpoint(tiny_llama_path, tmp_path / "model", "gptq", 4, 32)
    with pytest.raises(ValueError, match="already quantized"):
        cpu_engine(path, num_blocks=16, quantization="int8")
