"""GGUF files written by llama.cpp's own `llama-quantize` (tests/fixtures/llamacpp/, made by
tests/support/make_llamacpp_fixtures.py from a tiny random Llama; MoE files made here when llama-quantize is built):
every tensor unpacks to exactly what gguf-py's dequantize gives, and the file served as stored gives transformers'
greedy tokens and prompt logprobs on those dequantized weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.moe import QuantizedExperts
from pagedserve.backend.model.quantized import QuantizedEmbedding, QuantizedLinear
from pagedserve.kernels.quant_linear import QuantizedWeight
from pagedserve.testing import make_tiny_model
from tests.engine.test_gguf_families import _WIDE
from tests.engine.test_gguf_families import FAMILIES as DENSE
from tests.support import tiny_gguf
from tests.support.make_llamacpp_fixtures import (
    TYPES,
    built_llama_quantize,
    fixture,
    llama_quantize,
    make_hf_model,
)
from tests.support.parity import assert_served_file_matches_transformers

# The types llama-quantize chose within each mix (the tied token table as the output, Q6_K).
MIXES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q6_K": {"Q6_K"}, "Q5_K_S": {"Q5_K", "Q6_K"},
         "Q3_K_M": {"Q3_K", "Q4_K", "Q5_K", "Q6_K"}, "IQ4_XS": {"IQ4_XS", "Q6_K"}}




def test_the_fixtures_are_small():
    assert sum(fixture(kind).stat().st_size for kind in TYPES) < 2 * 2**20


@pytest.mark.parametrize("kind", TYPES)
def test_every_tensor_of_a_llama_quantize_file_unpacks_as_gguf_dequantizes_it(kind):
    found = set()
    for tensor in gguf_file.read(fixture(kind)).tensors:
        got = gguf_file.unpack(tensor)
        if isinstance(got, QuantizedWeight):
            got = got.dequantize()
            found.add(tensor.tensor_type.name)
        assert torch.equal(got, torch.from_numpy(tiny_gguf.dequantized(tensor))), tensor.name
    assert found == MIXES[kind]


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict:
    """Per fixture, the tiny model's folder holding the weights gguf-py dequantizes from it."""
    return {kind: tiny_gguf.write_dequantized_twin(fixture(kind), make_hf_model(tmp_path_factory.mktemp(kind) / "hf"))
            for kind in TYPES}


@pytest.mark.parametrize("kind", TYPES)
def test_a_llama_quantize_file_serves_transformers_tokens_on_its_dequantized_weights(kind, twins, hf_reference):
    model = load_gguf_model(fixture(kind), torch.float32, torch.device("cpu"), 1024)
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head.weight is model.embed_tokens.weight
    assert_served_file_matches_transformers(fixture(kind), twins[kind], hf_reference, seed=37)


# MoE files are too large to commit; made here by llama-quantize when bench/llamacpp_peer has built it.
MOE = {"mixtral": {"num_local_experts": 4},
       "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256},
       "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 256, "head_dim": 64}}


@pytest.mark.slow
@pytest.mark.skipif(built_llama_quantize() is None, reason="llama-quantize not built (bench/llamacpp_peer.py)")
@pytest.mark.parametrize("family", list(MOE))
def test_a_llama_quantize_moe_file_serves_its_experts_with_transformers_tokens(family, hf_reference, tmp_path):
    folder = make_tiny_model(tmp_path / "hf", family, seed=38, hidden_size=256, intermediate_size=256, num_heads=4,
                             num_kv_heads=2, random_norms=True, config_extras=MOE[family])
    path = _llama_quantized(folder, tmp_path, "Q4_K_M")
    kinds = {t.name.split(".")[-2]: t.tensor_type.name for t in gguf_file.read(path).tensors}
    assert (kinds["ffn_gate_exps"], kinds["ffn_down_exps"], kinds["ffn_gate_inp"]) == ("Q4_K", "Q6_K", "F32")
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    assert all(isinstance(layer.mlp.experts, QuantizedExperts) for layer in model.layers)
    assert_served_file_matches_transformers(path, tiny_gguf.write_dequantized_twin(path, folder), hf_reference, seed=37)


@pytest.mark.slow
@pytest.mark.skipif(built_llama_quantize() is None, reason="llama-quantize not built (bench/llamacpp_peer.py)")
@pytest.mark.parametrize("family", ["qwen2", *DENSE])
def test_a_llama_quantize_file_of_each_dense_family_gives_transformers_tokens(family, hf_reference, tmp_path):
    folder = make_tiny_model(tmp_path / "hf", family.split("-")[0], seed=39, **{**_WIDE, **DENSE.get(family, {})})
    path = _llama_quantized(folder, tmp_path, "Q4_K_M")
    assert {t.tensor_type.name for t in gguf_file.read(path).tensors} >= {"Q4_K", "Q6_K"}
    assert_served_file_matches_transformers(path, tiny_gguf.write_dequantized_twin(path, folder), hf_reference, seed=37)


def _llama_quantized(folder, tmp_path, kind: str):
    """The tiny model in `folder` as tiny_gguf's F32 file quantized by llama-quantize to `kind`."""
    source = tiny_gguf.write_blocks_gguf(folder, tmp_path / "f32.gguf", lambda name: None)
    return llama_quantize(built_llama_quantize(), source, tmp_path / f"{kind}.gguf", kind)
