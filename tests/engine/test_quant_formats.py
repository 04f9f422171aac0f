"""GPTQ, AWQ and compressed-tensors checkpoints: tensors packed by the test from known integers, zeros and scales
unpack to exactly (q - zero) * scale; a tiny model saved in each format serves like its dequantized fp32 twin;
unsupported configs are refused naming what is unsupported."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model.quant_formats import QuantFormatError, Scheme, scheme_from_config
from pagedserve.backend.model.quantized import QuantizedLinear, weight_bytes
from tests.support.engines import cpu_engine
from tests.support.quant_checkpoints import gptq_parts, packed_parts, write_quantized_checkpoint


def _known(n: int, k: int, bits: int, group: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 1 << bits, (n, k))
    zeros = rng.integers(0, 1 << bits, (n, k // group))
    scales = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float16)
    dense = (q - np.repeat(zeros, group, 1)).astype(np.float32) * np.repeat(scales.astype(np.float32), group, 1)
    return q, zeros, scales, dense


CASES = [("gptq", 4, 32, False), ("gptq", 8, 64, False), ("gptq_v2", 4, 128, False), ("gptq", 4, 32, True),
         ("awq", 4, 32, False), ("compressed-tensors", 4, 32, True), ("compressed-tensors", 4, 64, False),
         ("compressed-tensors", 8, 32, True)]


@pytest.mark.parametrize(("method", "bits", "group", "symmetric"), CASES)
def test_packed_projection_unpacks_to_exactly_q_minus_zero_times_scale(method, bits, group, symmetric):
    n, k = 24, 256
    q, zeros, scales, _ = _known(n, k, bits, group, seed=bits * group)
    if symmetric:
        zeros = np.full_like(zeros, 1 << (bits - 1))
    parts = packed_parts(method, q, zeros, scales, bits, symmetric)
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
    parts = {**gptq_parts(q, zeros, scales, 4), "g_idx": torch.arange(64) % 2}
    with pytest.raises(QuantFormatError, match="g_idx is not contiguous"):
        Scheme("gptq", 4, 32, False, True).to_weight(parts, "x")


@pytest.mark.parametrize(("method", "bits"), [("gptq", 4), ("gptq", 8), ("awq", 4), ("compressed-tensors", 4)])
def test_a_quantized_checkpoint_serves_like_its_dequantized_twin(tiny_llama_path, tmp_path, method, bits):
    path = write_quantized_checkpoint(tiny_llama_path, tmp_path / "model", method, bits, 32)
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
    path = write_quantized_checkpoint(tiny_llama_path, tmp_path / "model", "gptq", 4, 32)
    with pytest.raises(ValueError, match="already quantized"):
        cpu_engine(path, num_blocks=16, quantization="int8")
