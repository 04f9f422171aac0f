"""Sliding-window models against transformers: a window shorter than the prompts, through chunked prefill,
preemption and prefix-cache hits (the KV blocks outside the window are kept, so a hit is exactly a recompute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine
from tests.support.parity import assert_staggered_batch_matches_transformers, parity_prompts

WINDOW = 6  # shorter than every parity prompt but the first, and not a multiple of the 4-token block


@pytest.fixture(scope="module")
def tiny_mistral_window_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mistral whose every layer slides over WINDOW tokens."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral-window"), "mistral", seed=21,
                           config_extras={"sliding_window": WINDOW})


@pytest.fixture(scope="module")
def tiny_qwen2_window_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 with use_sliding_window from layer 1 on (max_window_layers 1): layer 0 attends globally."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-window"), "qwen2", seed=22,
                           config_extras={"use_sliding_window": True, "sliding_window": WINDOW,
                                          "max_window_layers": 1})


@pytest.mark.parametrize("model_fixture", ["tiny_mistral_window_path", "tiny_qwen2_window_path"])
def test_windowed_staggered_batch_matches_transformers(model_fixture, request, hf_reference):
    assert_staggered_batch_matches_transformers(request.getfixturevalue(model_fixture), hf_reference)


def test_window_matters_for_these_prompts(tiny_mistral_window_path, tmp_path):
    # The same weights without the window answer differently, so the parity above checks the window.
    unwindowed = make_tiny_model(tmp_path / "plain", "mistral", seed=21)
    prompt = parity_prompts(384)[7]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    windowed, plain = (cpu_engine(path, num_blocks=32).generate([prompt], params)[0].prompt_logprobs
                       for path in (tiny_mistral_window_path, unwindowed))
    assert windowed[:WINDOW + 1] == plain[:WINDOW + 1]  # identical while the context fits in the window
    assert windowed[-1] != plain[-1]


def test_layers_take_their_own_window(tiny_qwen2_window_path, tiny_mistral_window_path):
    qwen2 = ModelArchConfig.from_pretrained(tiny_qwen2_window_path)
    assert [qwen2.window_of(i) for i in range(2)] == [None, WINDOW]
    mistral = cpu_engine(tiny_mistral_window_path, num_blocks=8, max_model_len=64)
    assert [layer.self_attn.sliding_window for layer in mistral.runner.model.layers] == [WINDOW, WINDOW]


def test_layer_types_of_an_unknown_kind_are_refused_by_name(tiny_qwen2_window_path):
    import json

    config = json.loads((tiny_qwen2_window_path / "config.json").read_text())
    config["layer_types"] = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModelError, match=r"layer_types .*\['chunked_attention'\]"):
        ModelArchConfig.from_dict(config)


def test_prefix_cache_hit_past_the_window_equals_the_computed_run(tiny_mistral_window_path):
    engine = cpu_engine(tiny_mistral_window_path, block_size=4, num_blocks=32)
    prompt = parity_prompts(engine.vocab_size)[6]  # 52 tokens: 13 full blocks, most of them outside the window
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    first = engine.generate([prompt], params)[0]
    hits = engine.get_stats().prefix_cache_hits
    second = engine.generate([prompt], params)[0]
    assert engine.get_stats().prefix_cache_hits > hits
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # The hit attends over the window's keys only where the first run masked a whole prompt's: the same sums in
    # another order, so equal to fp32 rounding rather than bit for bit.
    for hit, computed in zip(second.outputs[0].logprobs, first.outputs[0].logprobs, strict=True):
        assert hit == pytest.approx(computed, abs=1e-5)
