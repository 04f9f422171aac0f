"""GGUF files of K-quant, 5-bit and IQ4 tensors served as stored: each format's tiny llama (and a Q4_K_M-like mix of
Q4_K and Q6_K) gives transformers' greedy tokens on the dequantized weights; bad files are refused by name."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch

from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.gguf_file import GGUFError
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.quantized import QuantizedEmbedding, QuantizedLinear
from pagedserve.kernels import native
from pagedserve.kernels.quant_linear import native_gemm
from pagedserve.testing import make_tiny_model
from tests.support import tiny_gguf
from tests.support.engines import cpu_engine, greedy

KINDS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q5_0", "Q5_1"]


def q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M choice in small: Q6_K for the output, layer 0's attn_v and layer 1's ffn_down."""
    return "Q6_K" if name in ("output.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight") else "Q4_K"


@pytest.fixture(scope="module")
def wide_llama_path(tmp_path_factory):
    """A tiny untied llama whose every weight row is whole 256-value super-blocks."""
    return make_tiny_model(tmp_path_factory.mktemp("wide-llama"), "llama", hidden_size=256, intermediate_size=512,
                           num_heads=4, num_kv_heads=2, seed=11)


def _prompts(vocab: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 20))] for _ in range(count)]


def _assert_greedy_matches_transformers(path, hf_reference, max_tokens: int = 10) -> None:
    engine = cpu_engine(path, num_blocks=64, block_size=4)
    twin = path.with_suffix(".ref")
    prompts = _prompts(engine.vocab_size)
    outputs = [out.outputs[0].token_ids for out in engine.generate(prompts, greedy(max_tokens))]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_reference.greedy(twin, prompt, max_tokens)[0], prompt
    assert len({t for got in outputs for t in got}) >= 20  # the random weights make no degenerate model


@pytest.mark.parametrize("kind", KINDS)
def test_a_gguf_of_one_format_gives_transformers_greedy_tokens_on_its_dequantized_weights(
        kind, wide_llama_path, hf_reference, tmp_path):
    path = tiny_gguf.write_blocks_gguf(wide_llama_path, tmp_path / f"{kind}.gguf", lambda name: kind)
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    assert isinstance(model.layers[1].mlp.down_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    from safetensors.torch import load_file

    ref = load_file(str(path.with_suffix(".ref") / "model.safetensors"))
    qkv = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight.dequantize(), qkv)
    assert torch.equal(model.embed_tokens.weight.dequantize(), ref["model.embed_tokens.weight"])
    _assert_greedy_matches_transformers(path, hf_reference)


def test_a_q4_k_m_mix_fuses_q4_k_with_q6_k_exactly_and_gives_transformers_greedy_tokens(
        wide_llama_path, hf_reference, tmp_path):
    path = tiny_gguf.write_blocks_gguf(wide_llama_path, tmp_path / "q4_k_m.gguf", q4_k_m, seed=1)
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    mixed, plain = model.layers[0].self_attn.qkv_proj.weight, model.layers[1].self_attn.qkv_proj.weight
    assert (mixed.bits, mixed.group_size) == (8, 16) and (plain.bits, plain.group_size) == (4, 32)
    from safetensors.torch import load_file

    ref = load_file(str(path.with_suffix(".ref") / "model.safetensors"))
    qkv = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(mixed.dequantize(), qkv)
    if native.load() is not None:  # Q4_K's steps regrouped to 16 beside Q6_K's: the fused weight keeps the factoring
        assert mixed.packed["cpu_native"].kind == native_gemm.STEPS_TIMES_HALF
    assert torch.equal(model.lm_head.weight.dequantize(), ref["lm_head.weight"])
    _assert_greedy_matches_transformers(path, hf_reference)


def test_metadata_contradicting_the_tensors_is_refused_naming_the_tensor_and_key(wide_llama_path, tmp_path):
    path = tiny_gguf.write_blocks_gguf(wide_llama_path, tmp_path / "ffn.gguf", q4_k_m,
                                       metadata={"intermediate_size": 256})
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_gate\.weight', 'blk\.0\.ffn_up\.weight' stack to shape "
                                        r"\(1024, 256\).*feed_forward_length.*\(512, 256\)"):
        load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    path = tiny_gguf.write_blocks_gguf(wide_llama_path, tmp_path / "heads.gguf", q4_k_m,
                                       metadata={"num_attention_heads": 3})
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has 256 rows.*attention\.head_count \(3\)"):
        load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)


@pytest.mark.parametrize("fraction", [0.2, 0.9])
def test_a_truncated_k_quant_gguf_is_refused(wide_llama_path, tmp_path, fraction):
    path = tiny_gguf.write_blocks_gguf(wide_llama_path, tmp_path / "whole.gguf", q4_k_m)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(GGUFError, match="truncated"):
        cpu_engine(cut, num_blocks=16)


def test_a_missing_metadata_key_is_refused_naming_it(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"lacks the metadata key llama\.feed_forward_length"):
        gguf_file.config_dict(tmp_path / "bare.gguf")
