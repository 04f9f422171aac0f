"""GGUF files of every dense family llama.cpp converts (qwen3, phi3, gemma2, gemma3), K-quants mixed as Q4_K_M
mixes them: each architecture's metadata becomes our family's config, and greedy tokens equal transformers' on the
dequantized weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.gguf_file import GGUFError
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.quantized import QuantizedEmbedding, QuantizedLinear
from pagedserve.testing import make_tiny_model
from tests.support import tiny_gguf
from tests.support.parity import assert_served_file_matches_transformers

# Every width a whole number of 256-value super-blocks: head_dim 64 over 4 heads.
_WIDE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, random_norms=True)
FAMILIES = {
    # Llama 3.1's rope scaling, which the file holds only as llama.cpp's per-frequency factors (rope_freqs.weight).
    "llama-llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(config_extras={"head_dim": 64}),
    "phi3": dict(config_extras={"partial_rotary_factor": 0.5}),
    # LongRoPE past an original context of 4 (every prompt longer): the long factors, as transformers uses them.
    "phi3-longrope": dict(max_position_embeddings=256, config_extras={
        "original_max_position_embeddings": 4,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.25 * i for i in range(32)],
                            "long_factor": [3.0 + 0.5 * i for i in range(32)], "original_max_position_embeddings": 4}}),
    "gemma2": dict(tie_word_embeddings=True,
                   config_extras={"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 8,
                                  "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
    # Six layers: llama.cpp's Gemma 3 has five sliding layers to a global one, its local rope base 10000.
    "gemma3": dict(tie_word_embeddings=True, num_layers=6,
                   config_extras={"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 8,
                                  "sliding_window_pattern": 6,
                                  "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                      "sliding_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}}),
}


def q4_k_m(name: str) -> str:
    """Q6_K for v, down and the output (llama.cpp's Q4_K_M keeps these wider), Q4_K elsewhere."""
    return "Q6_K" if any(part in name for part in ("attn_v", "ffn_down", "output.", "attn_qkv")) else "Q4_K"


def _fields(cfg: ModelArchConfig) -> dict:
    """The config's fields as the file's metadata can hold them: eps in fp32, each layer's window."""
    fields = dataclasses.asdict(cfg)
    fields.pop("torch_dtype")
    fields["rms_norm_eps"] = float(np.float32(cfg.rms_norm_eps))
    fields["sliding_layers"] = [cfg.window_of(i) for i in range(cfg.num_layers)]
    return fields


def q5_k_m(name: str) -> str:
    """Q5_K_M: Q6_K where Q4_K_M has it, Q5_K elsewhere."""
    return "Q6_K" if q4_k_m(name) == "Q6_K" else "Q5_K"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_s_gguf_gives_transformers_greedy_tokens_on_its_dequantized_weights(family, hf_reference,
                                                                                      tmp_path):
    _family_matches_transformers(family, q4_k_m, hf_reference, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q5_K_M", "Q6_K"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_s_q5_k_m_and_q6_k_files_give_transformers_greedy_tokens(family, mix, hf_reference, tmp_path):
    _family_matches_transformers(family, q5_k_m if mix == "Q5_K_M" else (lambda name: "Q6_K"), hf_reference,
                                 tmp_path)


def _family_matches_transformers(family: str, kind_of, hf_reference, tmp_path) -> None:
    arch = family.split("-")[0]
    folder = make_tiny_model(tmp_path / "hf", arch, seed=21, **{**_WIDE, **FAMILIES[family]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / f"{family}.gguf", kind_of)
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert type(model).__name__.lower().startswith(arch[:5])
    assert _fields(model.config) == _fields(ModelArchConfig.from_pretrained(path.with_suffix(".ref")))
    assert_served_file_matches_transformers(path, path.with_suffix(".ref"), hf_reference, seed=8)


def test_rope_factors_no_llama3_scaling_reproduces_are_refused_naming_the_tensor(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "llama", seed=22, **_WIDE)
    odd = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 3.0, "original_max_position_embeddings": 64}  # a high_freq_factor Llama 3 never used
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / "odd.gguf", q4_k_m, metadata={"rope_parameters": odd})
    with pytest.raises(GGUFError, match=r"'rope_freqs\.weight' holds rope factors that no llama3 rope scaling"):
        load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)


def test_a_tied_quantized_gemma_table_is_looked_up_as_stored_and_held_once(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "gemma2", seed=27, **{**_WIDE, **FAMILIES["gemma2"]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / "tied.gguf", q4_k_m)
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    table = model.embed_tokens.weight
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head.weight is table
    assert table.bits == 4 and table.qweight is None and table.scales is None  # the GEMM's tiles hold it alone
    want = load_file(str(path.with_suffix(".ref") / "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.tensor([0, 7, 300, 7])
    assert torch.equal(model.embed_tokens(ids), want[ids])
    assert torch.equal(model.embed(ids), want[ids] * torch.tensor(256**0.5))


def test_an_untied_quantized_table_is_held_once_too(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "qwen3", seed=28, **{**_WIDE, **FAMILIES["qwen3"]})
    path = tiny_gguf.write_blocks_gguf(folder, tmp_path / "untied.gguf", q4_k_m)
    model = load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)
    table = model.embed_tokens.weight
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head.weight is not table
    held = sum(t.numel() * t.element_size() for t in table.tensors().values()) + table.packed_nbytes()
    assert table.bits == 4 and held * 8 / (table.out_features * table.in_features) < 4.7  # Q4_K's 4.5 and a little
    want = load_file(str(path.with_suffix(".ref") / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens(torch.tensor([3, 1])), want[[3, 1]])
