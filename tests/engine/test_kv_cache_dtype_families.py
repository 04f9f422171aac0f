"""Every family the registry serves on an 8-bit KV cache: greedy agreement with the bf16-KV engine (the
first-divergence distribution is printed) and the KL of the first-token distributions of a seeded sampled run.

The tiny random models are chaotic: their argmax margins are small, so even bf16 against fp32 weights agrees on
only 50-94 % of 16-token sequences, and over 64 x 64 the fp8 KV engine keeps 2-38 % of the sequences identical
(median first divergence 8-15 tokens) with first-token KL 0.7-3.6e-3 (Mixtral 2.2e-2). The bounds here are those
measurements with margin, not the issue's goal (>= 90 % identical, mean KL <= 1e-3), which the tiny models miss:
e4m3 rounds every K and V to 3 mantissa bits, and teacher-forced along bf16's greedy tokens that alone flips the
argmax at 4-9 % of positions. Computed scales (calculate_kv_scales) measured the same within noise here (2-34 %
identical, KL 0.7-6.9e-3, Mixtral 3.1e-2; per-token KL +-10 %): they move values out of e4m3's subnormals, and the
tiny models have few there; each family's calibration forward is checked to set them within the same bounds.
bench/kv_cache.py measures the default model. A wrong cache write or read (a slot, a scale, a format) diverges at
the first token with a KL near 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.backend.model.llama import Attention
from pagedserve.backend.model.registry import SUPPORTED_ARCHITECTURES
from pagedserve.testing import make_tiny_idefics3, make_tiny_llava, make_tiny_model, make_tiny_qwen2_5_vl
from pagedserve.testing_pooling import make_tiny_decoder_classifier, make_tiny_encoder, make_tiny_modernbert
from pagedserve.testing_vlm import make_tiny_gemma3_vl
from tests.support.kv_cache_dtype import (
    agreement,
    first_token_logits,
    greedy_tokens,
    make_engine,
    mean_kl,
    prompts_for,
)

TEXT_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3")
# Mixtral's top-2 of few experts flips its routing under small perturbations: its first tokens move most.
# The tiny Gemma 3 VLM is ~100x as sensitive as the others to any rounding (its first-token KL bf16 against fp32
# weights 9.4e-3, Gemma 3 text's 8.9e-5): over 64 x 64 fp8 KV keeps its first 4.9 tokens on average, 12 of 64
# differ at the first, KL 7.7e-2 (e5m2 2.2e-1); a wrong read would still sit near 1.
KL_BOUND = {"mixtral": 5e-2, "gemma3_vl": 2e-1}
MIN_MEAN_DIVERGENCE = {"gemma3_vl": 1.0}
FIRST_TOKEN_SHARE = {"gemma3_vl": 0.5}
# With computed scales every stored value rounds differently: Mixtral's routing flips move its first-token KL 2x
# (8 prompts: 2.3e-2 with scales 1.0, 4.8e-2 computed; 64 prompts: 2.2e-2, 3.1e-2).
COMPUTED_KL_BOUND = {**KL_BOUND, "mixtral": 1e-1}
DEFAULT_KL_BOUND = 1e-2
FAMILIES = [*TEXT_ARCHS, "llava", "qwen2_5_vl", "qwen2_vl", "idefics3", "gemma3_vl"]
PROMPT_IDS = 300  # below the tiny tokenizers' special and image tokens


def _make(arch: str, path: Path) -> Path:
    if arch == "llava":
        return make_tiny_llava(path)
    if arch in ("qwen2_5_vl", "qwen2_vl"):
        return make_tiny_qwen2_5_vl(path, qwen2=arch == "qwen2_vl")
    if arch == "idefics3":
        return make_tiny_idefics3(path)
    if arch == "gemma3_vl":
        return make_tiny_gemma3_vl(path)
    return make_tiny_model(path, arch)


def _check_family(path: Path, label: str, count: int, max_tokens: int) -> None:
    prompts = prompts_for(PROMPT_IDS, count, seed=11)
    bf16, fp8, e5m2 = (make_engine(path, kv) for kv in ("auto", "fp8", "fp8_e5m2"))
    computed = make_engine(path, "fp8", calculate_kv_scales=True)
    assert fp8.runner.key_caches[0].dtype == torch.float8_e4m3fn
    scales = [(m.k_scale, m.v_scale) for m in computed.runner.model.modules() if isinstance(m, Attention)]
    assert scales and all(0 < s != 1.0 for pair in scales for s in pair), scales  # every layer's, from its forward
    greedy = agreement(greedy_tokens(bf16, prompts, max_tokens), greedy_tokens(fp8, prompts, max_tokens))
    base_logits, _ = first_token_logits(bf16, prompts)
    kl = mean_kl(base_logits, first_token_logits(fp8, prompts)[0])
    kl_e5m2 = mean_kl(base_logits, first_token_logits(e5m2, prompts)[0])
    kl_computed = mean_kl(base_logits, first_token_logits(computed, prompts)[0])
    print(f"{label} fp8 KV, {count} x {max_tokens}: {greedy.describe()}; first-token KL e4m3 {kl:.2e}, "
          f"e5m2 {kl_e5m2:.2e}, e4m3 with computed scales {kl_computed:.2e}")
    # Identical sequences count as diverging at max_tokens: on average the first quarter agrees (the first 8
    # tokens over 64, where the tiny models' chaos has had time to grow), and few differ from the first token.
    mean_divergence = sum(max_tokens if d is None else d for d in greedy.divergences) / count
    assert mean_divergence >= MIN_MEAN_DIVERGENCE.get(label, min(max_tokens / 4, 8)), greedy.describe()
    assert sum(d == 0 for d in greedy.divergences) <= count * FIRST_TOKEN_SHARE.get(label, 1 / 4), greedy.describe()
    assert kl <= KL_BOUND.get(label, DEFAULT_KL_BOUND)
    assert kl_computed <= COMPUTED_KL_BOUND.get(label, DEFAULT_KL_BOUND)
    assert kl < kl_e5m2  # e4m3 keeps one more mantissa bit than e5m2: its distribution is the closer


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_generating_family_agrees_with_its_bf16_kv_engine(arch, tmp_path):
    _check_family(_make(arch, tmp_path / arch), arch, 8, 16)


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_over_64_prompts_of_64_tokens(arch, tmp_path):
    _check_family(_make(arch, tmp_path / arch), arch, 64, 64)


def test_a_decoder_classifier_scores_alike_on_fp8_kv(tmp_path):
    path = make_tiny_decoder_classifier(tmp_path / "cls", "qwen3")
    texts = ["a short text", "another one, somewhat longer than the first"]
    auto = torch.tensor([out.pooled for out in make_engine(path, "auto").encode(texts)])
    fp8 = torch.tensor([out.pooled for out in make_engine(path, "fp8").encode(texts)])
    torch.testing.assert_close(fp8, auto, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("family", ["bert", "xlm_roberta", "modernbert"])
def test_encoders_ignore_the_kv_cache_dtype(family, tmp_path):
    path = (make_tiny_modernbert(tmp_path / family) if family == "modernbert"
            else make_tiny_encoder(tmp_path / family, family, pooling="mean"))
    texts = ["a short text", "another one, somewhat longer than the first"]
    auto = [out.pooled for out in make_engine(path, "auto", dtype="float32").encode(texts)]
    fp8 = [out.pooled for out in make_engine(path, "fp8", dtype="float32").encode(texts)]
    assert torch.equal(torch.tensor(auto), torch.tensor(fp8))


def test_every_registered_architecture_is_covered_here():
    covered = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
               "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
               "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
               "Qwen2VLForConditionalGeneration", "Idefics3ForConditionalGeneration",
               "Qwen3ForSequenceClassification", "BertModel", "XLMRobertaModel", "ModernBertModel"}
    # Same model code as a covered one: the classifier heads of the covered encoders and decoders.
    same_code = {"BertForSequenceClassification", "XLMRobertaForSequenceClassification",
                 "ModernBertForSequenceClassification", "LlamaForSequenceClassification",
                 "MistralForSequenceClassification", "Qwen2ForSequenceClassification"}
    assert set(SUPPORTED_ARCHITECTURES) <= covered | same_code
