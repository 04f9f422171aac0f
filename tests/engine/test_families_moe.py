"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers: tiny random checkpoints (8 experts, top-2) saved by
transformers' own classes run the staggered parity batch (chunked prefill, preemption, prefix-cache hits); steps
with fewer tokens than experts and with every token on the same experts stay exact; expert tensors load from the
per-expert or the stacked form, and a checkpoint that lacks one is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import kernels
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.llama import MLP
from pagedserve.backend.model.moe import SparseMoeBlock
from pagedserve.backend.model.quantized import QuantizedLinear
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine, greedy
from tests.support.kernel_checks import spy
from tests.support.parity import assert_staggered_batch_matches_transformers, parity_prompts

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def tiny_mixtral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mixtral of 8 experts, top-2, every layer sparse."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral", seed=21, random_norms=True)


@pytest.fixture(scope="module")
def tiny_qwen2_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-MoE (QKV bias, a shared expert, top-k not renormalised) whose last of 3 layers is dense."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-moe"), "qwen2_moe", seed=22, random_norms=True,
                           num_layers=3, config_extras={"mlp_only_layers": [2]})


@pytest.fixture(scope="module")
def tiny_qwen3_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE (q/k norms, head_dim 32, renormalised top-k) sparse every second layer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe", seed=23, random_norms=True,
                           config_extras={"decoder_sparse_step": 2})


@pytest.mark.parametrize("model_fixture", ["tiny_mixtral_path", "tiny_qwen2_moe_path", "tiny_qwen3_moe_path"])
def test_staggered_batch_matches_transformers_greedy_per_prompt(model_fixture, request, hf_reference):
    assert_staggered_batch_matches_transformers(request.getfixturevalue(model_fixture), hf_reference)


@pytest.mark.parametrize(("model_fixture", "sparse"), [("tiny_mixtral_path", [True, True]),
                                                      ("tiny_qwen2_moe_path", [True, True, False]),
                                                      ("tiny_qwen3_moe_path", [False, True])])
def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers(model_fixture, sparse, request):
    layers = cpu_engine(request.getfixturevalue(model_fixture), num_blocks=8).runner.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == sparse
    assert all(isinstance(layer.mlp, MLP) for layer, is_sparse in zip(layers, sparse, strict=True) if not is_sparse)


def test_qwen2_moe_reads_its_shared_expert_and_routing(tiny_qwen2_moe_path):
    cfg = ModelArchConfig.from_pretrained(tiny_qwen2_moe_path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (NUM_EXPERTS, 2, 32)
    assert cfg.shared_expert_intermediate_size == 96 and cfg.qkv_bias and not cfg.o_bias
    assert not cfg.norm_topk_prob and cfg.round_routing_weights and cfg.mlp_only_layers == (2,)
    mixtral = ModelArchConfig.from_dict({**json.loads((tiny_qwen2_moe_path / "config.json").read_text()),
                                         "architectures": ["MixtralForCausalLM"], "num_local_experts": 4})
    assert mixtral.norm_topk_prob and not mixtral.round_routing_weights and mixtral.num_experts == 4


def test_decode_steps_with_fewer_tokens_than_experts_match_transformers(tiny_qwen3_moe_path, hf_reference,
                                                                        monkeypatch):
    calls = spy(monkeypatch, kernels, "fused_moe")
    engine = cpu_engine(tiny_qwen3_moe_path, block_size=4, num_blocks=32)
    prompt = parity_prompts(engine.vocab_size)[1]
    out = engine.generate([prompt], greedy(8, logprobs=0))[0].outputs[0]
    assert min(args[0].shape[0] for args in calls) == 1 < NUM_EXPERTS
    tokens, logprobs = hf_reference.greedy(tiny_qwen3_moe_path, prompt, 8)
    assert out.token_ids == tokens
    assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)] == pytest.approx(logprobs, abs=1e-4)


def test_every_token_on_the_same_experts_matches_transformers(tiny_mixtral_path, hf_reference, tmp_path,
                                                              monkeypatch):
    # A zero router ties every expert: each token takes the same two, with weights of one half.
    folder = _edit_tensors(tiny_mixtral_path, tmp_path / "one-route",
                           lambda tensors: {n: torch.zeros_like(t) if n.endswith("moe.gate.weight") else t
                                            for n, t in tensors.items()})
    calls = spy(monkeypatch, kernels, "fused_moe")
    engine = cpu_engine(folder, block_size=4, num_blocks=32)
    prompts = parity_prompts(engine.vocab_size)[2:4]
    outs = engine.generate(prompts, greedy(5))
    ids = torch.cat([args[4] for args in calls])
    assert ids.shape[0] > 20 and (ids == ids[0]).all()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_reference.greedy(folder, prompt, 5)[0]


def test_stacked_expert_checkpoint_loads_as_the_per_expert_one(tiny_mixtral_path, tmp_path):
    folder = _edit_tensors(tiny_mixtral_path, tmp_path / "stacked", _stack_experts)
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in load_file(str(folder / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = parity_prompts(64)[4]
    got, want = (cpu_engine(path, num_blocks=16).generate([prompt], params)[0].prompt_logprobs[1:]
                 for path in (folder, tiny_mixtral_path))
    assert got == want


def test_checkpoint_missing_one_expert_projection_names_the_stacked_parameter(tiny_mixtral_path, tmp_path):
    folder = _edit_tensors(tiny_mixtral_path, tmp_path / "no-w3",
                           lambda tensors: {n: t for n, t in tensors.items()
                                            if n != "model.layers.1.block_sparse_moe.experts.5.w3.weight"})
    with pytest.raises(ValueError, match=r"missing 1 weights, e.g. \['layers.1.mlp.experts.w13 \(parts filled: "
                                         r".*\[5, 0:128\].*\)'\]"):
        cpu_engine(folder, num_blocks=8)


def test_checkpoint_expert_past_the_configured_count_is_named(tiny_mixtral_path, tmp_path):
    folder = shutil.copytree(tiny_mixtral_path, tmp_path / "fewer-experts")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    with pytest.raises(ValueError, match=r"'model.layers.0.block_sparse_moe.experts.6.w1.weight' is expert 6 but "
                                         r"the config has 6"):
        cpu_engine(folder, num_blocks=8)


def test_top_k_above_the_number_of_experts_is_refused(tiny_qwen3_moe_path):
    config = json.loads((tiny_qwen3_moe_path / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok 9 must be in 1..8"):
        ModelArchConfig.from_dict({**config, "num_experts_per_tok": 9})


def test_int8_at_load_quantizes_attention_and_shared_expert_and_keeps_the_experts(tiny_qwen2_moe_path):
    engine = cpu_engine(tiny_qwen2_moe_path, quantization="int8", num_blocks=16)
    block = engine.runner.model.layers[0].mlp
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(block.shared_expert.gate_up_proj, QuantizedLinear)
    assert block.experts.w13.dtype == torch.float32
    assert len(engine.generate([parity_prompts(64)[0]], greedy(3))[0].outputs[0].token_ids) == 3


def _edit_tensors(source: Path, target: Path, edit) -> Path:
    """A copy of the model folder `source` whose tensors are edit(tensors)."""
    shutil.copytree(source, target)
    tensors = edit(load_file(str(target / "model.safetensors")))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's per-expert w1 / w3 / w2 as transformers 5 holds them: experts.gate_up_proj and experts.down_proj."""
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    layers = {n.split(".experts.")[0] for n in tensors if ".experts." in n}
    for layer in layers:
        def expert(e: int, w: str, layer: str = layer) -> torch.Tensor:
            return tensors[f"{layer}.experts.{e}.{w}.weight"]

        out[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([expert(e, "w1"), expert(e, "w3")]) for e in range(NUM_EXPERTS)])
        out[f"{layer}.experts.down_proj"] = torch.stack([expert(e, "w2") for e in range(NUM_EXPERTS)])
    return out
