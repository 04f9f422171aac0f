"""Qwen3 and Phi-3 / Phi-4 against transformers: tiny random checkpoints saved by transformers' own classes run
the staggered parity batch (chunked prefill, preemption, prefix-cache hits), and what they refuse is named."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.quantized import QuantizedLinear, quantize_weight
from pagedserve.kernels.rope.cos_sin import compute_cos_sin_cache
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine
from tests.support.parity import assert_staggered_batch_matches_transformers, parity_prompts
from tests.support.quant_checkpoints import write_quantized_checkpoint

# Every parity prompt (5 tokens and more) is longer than this original context, so transformers runs each one
# with the long factors from its prefill on, as the engine does for a context past the original.
PHI3_ORIGINAL_CONTEXT = 4
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.25 * i for i in range(8)],
    "long_factor": [3.0 + 2.0 * i for i in range(8)],
    "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
}
# Phi-4-mini's shape of rotary: 3/4 of each 16-dim head (12 dims, 6 factors), an explicit attention factor, and a
# context no longer than the original, so the short factors serve it.
PHI3_PARTIAL = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.5 * i for i in range(6)],
    "long_factor": [5.0] * 6,
    "original_max_position_embeddings": 128,
    "attention_factor": 1.2,
}


@pytest.fixture(scope="module")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 (head_dim 32 on a hidden size of 64 with 4 heads) whose q/k norm weights are drawn."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=11, random_norms=True)


@pytest.fixture(scope="module")
def tiny_phi3_longrope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Phi-3 with LongRoPE whose original context (4) every prompt exceeds; max_position_embeddings 256."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3-longrope"), "phi3", seed=12, random_norms=True,
                           rope_scaling=PHI3_LONGROPE, max_position_embeddings=256,
                           config_extras={"original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT})


@pytest.fixture(scope="module")
def tiny_phi3_partial_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Phi-3 with partial rotary (0.75) and LongRoPE within its original context of 128."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3-partial"), "phi3", seed=13, random_norms=True,
                           rope_scaling=PHI3_PARTIAL, max_position_embeddings=128,
                           config_extras={"original_max_position_embeddings": 128, "partial_rotary_factor": 0.75})


@pytest.fixture(scope="module")
def tiny_phi3_window_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Phi-3 sliding over 6 tokens in every layer, as Phi-3-mini-4k slides over 2047."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3-window"), "phi3", seed=14, random_norms=True,
                           config_extras={"sliding_window": 6})


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3_path", "tiny_phi3_longrope_path", "tiny_phi3_partial_path",
                                           "tiny_phi3_window_path"])
def test_staggered_batch_matches_transformers_greedy_per_prompt(model_fixture, request, hf_reference):
    assert_staggered_batch_matches_transformers(request.getfixturevalue(model_fixture), hf_reference)


def test_qwen3_reads_its_own_head_dim_and_prompt_logprobs_match(tiny_qwen3_path, hf_reference):
    engine = cpu_engine(tiny_qwen3_path, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    assert engine.runner.arch.head_dim == 32 != engine.runner.arch.hidden_size // engine.runner.arch.num_heads
    assert engine.runner.key_caches[0].shape[-1] == 32
    prompt = parity_prompts(engine.vocab_size)[6]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    got = [entry[tok] for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert got == pytest.approx(hf_reference.prompt_logprobs(tiny_qwen3_path, prompt), abs=1e-4)


def test_phi3_longrope_past_the_original_context_takes_the_long_factors_and_attention_factor(
        tiny_phi3_longrope_path):
    cfg = ModelArchConfig.from_pretrained(tiny_phi3_longrope_path)
    scaling = cfg.rope_scaling
    # transformers' default: factor 256 / 4 = 64, sqrt(1 + ln 64 / ln 4) = 2.
    assert scaling["attention_factor"] == pytest.approx(2.0)
    long_table = compute_cos_sin_cache(16, 256, cfg.rope_theta, scaling, torch.float32)
    short_table = compute_cos_sin_cache(16, PHI3_ORIGINAL_CONTEXT, cfg.rope_theta, scaling, torch.float32)
    # Position 1, first pair (frequency 1 / factor): 2 cos(1 / 3) with the long factor, 2 cos(1) with the short.
    assert long_table[1, 0].item() == pytest.approx(2.0 * math.cos(1 / 3.0))
    assert short_table[1, 0].item() == pytest.approx(2.0 * math.cos(1.0))


def test_phi3_longrope_takes_the_long_factors_once_max_model_len_passes_the_original_context(
        tiny_phi3_partial_path):
    within = cpu_engine(tiny_phi3_partial_path, num_blocks=8)  # max_model_len 128: the original context
    past = cpu_engine(tiny_phi3_partial_path, num_blocks=8, max_model_len=129)
    # Position 1, first pair, times the given attention factor 1.2: the short factor 1, the long one 5.
    assert within.runner.model.cos_sin_cache[1, 0].item() == pytest.approx(1.2 * math.cos(1.0))
    assert past.runner.model.cos_sin_cache[1, 0].item() == pytest.approx(1.2 * math.cos(1 / 5.0))
    assert past.runner.model.cos_sin_cache.shape == (129, 12)


def test_phi3_partial_rotary_leaves_the_last_dims_unrotated(tiny_phi3_partial_path):
    engine = cpu_engine(tiny_phi3_partial_path, num_blocks=16)
    assert engine.runner.arch.rotary_dim == 12 and engine.runner.arch.head_dim == 16
    assert engine.runner.model.cos_sin_cache.shape == (128, 12)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3_path", "tiny_phi3_longrope_path"])
def test_int8_on_the_fly_quantizes_every_projection_and_stays_close_to_its_dequantized_twin(
        model_fixture, request, tmp_path):
    path = request.getfixturevalue(model_fixture)
    twin = tmp_path / "dequantized"
    shutil.copytree(path, twin)
    tensors = load_file(str(twin / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):  # per output channel: a fused or an unfused row quantizes alike
            tensors[name] = quantize_weight(tensor, "int8").dequantize(tensor.dtype)
    save_file(tensors, str(twin / "model.safetensors"), metadata={"format": "pt"})
    settings = {"num_blocks": 32, "block_size": 4}
    quantized, reference = cpu_engine(path, quantization="int8", **settings), cpu_engine(twin, **settings)
    layers = quantized.runner.model.layers
    assert all(isinstance(getattr(layer.self_attn, name), QuantizedLinear) for layer in layers
               for name in ("qkv_proj", "o_proj"))
    prompt = parity_prompts(quantized.vocab_size)[5]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got, want = (engine.generate([prompt], params)[0].prompt_logprobs[1:] for engine in (quantized, reference))
    assert [g[t] for g, t in zip(got, prompt[1:], strict=True)] == pytest.approx(
        [w[t] for w, t in zip(want, prompt[1:], strict=True)], abs=0.1)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_phi3_quantized_checkpoint_with_fused_projections_serves_like_its_dequantized_twin(
        tiny_phi3_longrope_path, tmp_path, method):
    # Phi-3's quantized projections are its fused qkv_proj / gate_up_proj modules themselves.
    path = write_quantized_checkpoint(tiny_phi3_longrope_path, tmp_path / "model", method, 4, 32,
                                      projections=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    engine, twin = cpu_engine(path, num_blocks=32), cpu_engine(path.with_suffix(".ref"), num_blocks=32)
    assert sum(isinstance(m, QuantizedLinear) for m in engine.runner.model.modules()) == 4 * 2
    ref = load_file(str(path.with_suffix(".ref") / "model.safetensors"))
    assert torch.equal(engine.runner.model.layers[1].self_attn.qkv_proj.weight.dequantize(),
                       ref["model.layers.1.self_attn.qkv_proj.weight"])
    prompt = parity_prompts(engine.vocab_size)[5]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got, want = (e.generate([prompt], params)[0].prompt_logprobs[1:] for e in (engine, twin))
    assert max(abs(g[t] - w[t]) for g, w, t in zip(got, want, prompt[1:], strict=True)) < 0.1


def test_unknown_architecture_names_it_and_lists_the_supported_ones(tiny_qwen3_path, tmp_path):
    folder = _copy_with_config(tiny_qwen3_path, tmp_path / "falcon", architectures=["FalconForCausalLM"])
    with pytest.raises(UnsupportedModelError,
                       match=r"'FalconForCausalLM' is not supported; supported: .*Phi3ForCausalLM.*Qwen3ForCausalLM"):
        LLMEngine.from_pretrained(str(folder))


def test_qwen3_unsupported_rope_type_is_named(tiny_qwen3_path, tmp_path):
    config = json.loads((tiny_qwen3_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn' is not supported"):
        ModelArchConfig.from_dict(config)


def test_phi3_rotary_dimension_that_is_odd_is_refused(tiny_phi3_partial_path):
    config = json.loads((tiny_phi3_partial_path / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.3125  # 5 of 16 dims
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.3125 gives a rotary dimension of 5"):
        ModelArchConfig.from_dict(config)


def test_su_rope_of_early_phi3_configs_reads_as_longrope(tiny_phi3_longrope_path):
    config = json.loads((tiny_phi3_longrope_path / "config.json").read_text())
    config["rope_scaling"] = {k: v for k, v in config.pop("rope_parameters").items() if k != "rope_type"}
    config["rope_scaling"]["type"] = "su"
    cfg = ModelArchConfig.from_dict(config)
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(2.0)


def test_qwen3_checkpoint_without_a_q_norm_names_it(tiny_qwen3_path, tmp_path):
    folder = tmp_path / "no-q-norm"
    shutil.copytree(tiny_qwen3_path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights, e.g. \['layers.1.self_attn.q_norm.weight'\]"):
        cpu_engine(folder, num_blocks=8)


def test_phi3_fused_checkpoint_tensor_of_the_wrong_shape_is_named(tiny_phi3_longrope_path, tmp_path):
    folder = tmp_path / "short-qkv"
    shutil.copytree(tiny_phi3_longrope_path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(112, 64\), "
                                         r"expected \(128, 64\)"):
        cpu_engine(folder, num_blocks=8)


def _copy_with_config(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target

