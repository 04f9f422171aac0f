"""GGUF files of the mixture-of-experts families as llama.cpp writes them: qwen2moe (a shared expert beside the
routed ones), qwen3moe, and Mixtral stored as `llama` with its experts; each layer's experts stacked in one 3-D
tensor per projection (ffn_gate_exps / ffn_up_exps / ffn_down_exps), the router ffn_gate_inp kept F32. Greedy
tokens and every prompt logprob equal transformers' on the dequantized weights, with the experts served as stored."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.gguf_file import GGUFError
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.moe import QuantizedExperts
from pagedserve.backend.model.quantized import QuantizedLinear
from pagedserve.testing import make_tiny_model
from tests.engine.test_gguf_families import _fields, q4_k_m, q5_k_m
from tests.support import tiny_gguf
from tests.support.parity import assert_served_file_matches_transformers

# Every width a whole number of 256-value super-blocks; four experts, top-2.
_WIDE = dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, random_norms=True)
FAMILIES = {
    "mixtral": dict(config_extras={"num_local_experts": 4}),
    "qwen2_moe": dict(config_extras={"num_experts": 4, "moe_intermediate_size": 256,
                                     "shared_expert_intermediate_size": 256}),
    "qwen3_moe": dict(config_extras={"num_experts": 4, "moe_intermediate_size": 256, "head_dim": 64}),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_moe_gguf_serves_its_quantized_experts_as_stored_with_transformers_tokens(family, hf_reference, tmp_path):
    folder = make_tiny_model(tmp_path / "hf", family, seed=23, **{**_WIDE, **FAMILIES[family]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / f"{family}.gguf", q4_k_m)
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    block = model.layers[0].mlp
    assert isinstance(block.experts, QuantizedExperts) and len(block.experts.w13) == 4
    assert (block.experts.w13[0].weight.bits, block.experts.w2[0].weight.bits) == (4, 8)  # Q4_K, Q6_K as stored
    assert type(model).__name__.lower().startswith(family.replace("_", "")[:6])
    assert _fields(model.config) == _fields(ModelArchConfig.from_pretrained(path.with_suffix(".ref")))
    if family == "qwen2_moe":
        assert isinstance(block.shared_expert.gate_up_proj, QuantizedLinear)
    assert_served_file_matches_transformers(path, path.with_suffix(".ref"), hf_reference, seed=9)


@pytest.mark.slow
def test_float_expert_stacks_load_into_the_fused_moe_parameters(hf_reference, tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "qwen2_moe", seed=24, **{**_WIDE, **FAMILIES["qwen2_moe"]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / "f.gguf", lambda name: None if "_exps" in name else "Q8_0")
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    assert model.layers[1].mlp.experts.w13.shape == (4, 512, 256)
    assert_served_file_matches_transformers(path, path.with_suffix(".ref"), hf_reference, seed=9)


def test_an_expert_stack_the_metadata_contradicts_is_refused_naming_it(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=25, **{**_WIDE, **FAMILIES["qwen3_moe"]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / "odd.gguf", q4_k_m, metadata={"moe_intermediate_size": 512})
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_gate_exps\.weight' has shape \(4, 256, 256\), but the file's "
                                        r"metadata \(.*expert_feed_forward_length\) gives \(4, 512, 256\)"):
        load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)


def test_a_moe_architecture_without_expert_count_is_refused_naming_the_key(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=26, **{**_WIDE, **FAMILIES["qwen3_moe"]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / "bare.gguf", q4_k_m, metadata={"num_experts": 0, "num_local_experts": 0})
    with pytest.raises(GGUFError, match=r"lacks the metadata key qwen3moe\.expert_count"):
        load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)


def test_an_early_mixtral_file_with_one_tensor_per_expert_loads_as_the_stacked_one(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "mixtral", seed=27, **{**_WIDE, **FAMILIES["mixtral"]})
    stacked = tiny_gguf.write_blocks_gguf(folder, tmp_path / "stacked.gguf", q4_k_m)
    early = tiny_gguf.write_blocks_gguf(folder, tmp_path / "early.gguf", q4_k_m, stack_experts=False)
    assert "blk.1.ffn_down.3.weight" in gguf_file.tensors(early)
    x = torch.randn(5, 256)
    weights, ids = torch.rand(5, 2), torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [0, 3]])
    outs = []
    for path in (stacked, early):
        block = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024).layers[1].mlp
        assert isinstance(block.experts, QuantizedExperts)
        outs.append(block.experts(x, weights, ids))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q5_K_M", "Q6_K"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_moe_family_s_q5_k_m_and_q6_k_files_give_transformers_tokens(family, mix, hf_reference, tmp_path):
    folder = make_tiny_model(tmp_path / "hf", family, seed=23, **{**_WIDE, **FAMILIES[family]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / f"{family}.gguf",
                                      q5_k_m if mix == "Q5_K_M" else (lambda name: "Q6_K"))
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    assert isinstance(model.layers[1].mlp.experts, QuantizedExperts)
    assert_served_file_matches_transformers(path, path.with_suffix(".ref"), hf_reference, seed=9)
