"""calculate_kv_scales: each layer's K/V scales computed once at start from the calibration text (max |K| / 200,
max |V| / 100 of what the real cache would be handed), frozen from then on, the checkpoint's kept; and what they
buy: a model whose V values sit below e4m3's normal range (the default model's first layer has half its V there)
keeps its accuracy only with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pagedserve.backend.core.config import CacheConfig
from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.model.kv_calibration import K_SCALE_CONSTANT, V_SCALE_CONSTANT, calibration_ids
from pagedserve.backend.model.llama import Attention
from tests.engine.test_kv_cache_dtype import _with_kv_scales
from tests.support.kv_cache_dtype import first_token_logits, greedy_tokens, make_engine, mean_kl, prompts_for


def _scales(engine) -> list[tuple[float, float]]:
    return [(m.k_scale, m.v_scale) for m in engine.runner.model.modules() if isinstance(m, Attention)]


def _written_amax(path: Path, token_ids: list[int]) -> list[tuple[float, float]]:
    """Per layer, max |K| and max |V| a bf16 engine's cache holds after prefilling `token_ids` alone."""
    engine = make_engine(path, "auto", num_blocks=-(-len(token_ids) // 16) + 1, enable_prefix_caching=False)
    greedy_tokens(engine, [token_ids], 1)  # one token: only the prompt's K/V are written
    return [(float(k.abs().max().float()), float(v.abs().max().float())) for k, v in engine.runner.kv_caches]


def _expected(path: Path, engine) -> list[float]:
    """k_scale, v_scale of each layer by vLLM's rule over the calibration text as this engine cuts it."""
    ids = calibration_ids(engine.tokenizer, engine.scheduler_config.max_model_len)
    return [s for k, v in _written_amax(path, ids) for s in (k / K_SCALE_CONSTANT, v / V_SCALE_CONSTANT)]


def test_computed_scales_come_from_the_calibration_text_once_and_stay_frozen(tiny_llama_path):
    engine = make_engine(tiny_llama_path, "fp8", calculate_kv_scales=True)
    computed = _scales(engine)
    assert [s for pair in computed for s in pair] == pytest.approx(_expected(tiny_llama_path, engine), rel=1e-6)
    assert all(k != 1.0 and v != 1.0 for k, v in computed)
    # Requests after start (longer, other tokens) never move them: set once, not per step.
    greedy_tokens(engine, prompts_for(384, 8, seed=9) + [list(range(4, 300))], 24)
    assert _scales(engine) == computed


def test_the_calibration_text_is_cut_to_max_model_len(tiny_llama_path):
    # Past max_model_len the rotary table has no row: the text's first 32 tokens only.
    engine = make_engine(tiny_llama_path, "fp8", max_model_len=32, calculate_kv_scales=True)
    computed = [s for pair in _scales(engine) for s in pair]
    assert computed == pytest.approx(_expected(tiny_llama_path, engine), rel=1e-6)
    assert computed != [s for pair in _scales(make_engine(tiny_llama_path, "fp8", calculate_kv_scales=True))
                        for s in pair]


@pytest.mark.parametrize(("kv_cache_dtype", "calculate"), [("auto", True), ("fp8", False), ("fp8", None)])
def test_scales_stay_one_without_an_fp8_cache_or_the_parameter(tiny_llama_path, kv_cache_dtype, calculate):
    settings = {} if calculate is None else {"calculate_kv_scales": calculate}  # None: the default, off (vLLM's)
    engine = make_engine(tiny_llama_path, kv_cache_dtype, **settings)
    assert _scales(engine) == [(1.0, 1.0), (1.0, 1.0)]


def test_checkpoint_scales_are_kept_and_only_the_missing_ones_computed(tiny_llama_path, tmp_path):
    scaled = _with_kv_scales(tiny_llama_path, tmp_path / "scaled", {"model.layers.0.self_attn.k_scale": 0.5})
    computed = _scales(make_engine(tiny_llama_path, "fp8", calculate_kv_scales=True))
    mixed = _scales(make_engine(scaled, "fp8", calculate_kv_scales=True))
    assert mixed == [(0.5, computed[0][1]), computed[1]]
    both = _with_kv_scales(tiny_llama_path, tmp_path / "both", {"model.layers.0.self_attn.kv_scale": 0.25,
                                                               "model.layers.1.self_attn.kv_scale": 2.0})
    assert _scales(make_engine(both, "fp8", calculate_kv_scales=True)) == [(0.25, 0.25), (2.0, 2.0)]


def test_a_non_bool_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as refused:
        CacheConfig(calculate_kv_scales="yes")
    assert refused.value.field == "calculate_kv_scales"


def _with_small_values(source: Path, target: Path) -> Path:
    """The same function with every V 2^-10 as large (o_proj 2^10 as large): exact in bf16, but its V values fall
    below e4m3's smallest subnormal (2^-9) unless a scale lifts them."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    for name in list(tensors):
        if ".v_proj." in name:
            tensors[name] = tensors[name] * 2.0**-10
        elif name.endswith("o_proj.weight"):
            tensors[name] = tensors[name] * 2.0**10
    save_file(tensors, target / "model.safetensors")
    return target


def test_computed_scales_keep_a_model_with_small_values_as_accurate_as_one_without(tiny_llama_path, tmp_path):
    small = _with_small_values(tiny_llama_path, tmp_path / "small")
    prompts = prompts_for(384, 16, seed=12)

    def kl(path: Path, calculate: bool) -> float:
        base = first_token_logits(make_engine(path, "auto"), prompts)[0]
        return mean_kl(base, first_token_logits(make_engine(path, "fp8", calculate_kv_scales=calculate),
                                                prompts)[0])

    plain, small_unscaled, small_computed = kl(tiny_llama_path, True), kl(small, False), kl(small, True)
    assert small_unscaled > 10 * plain  # V flushed to zero: the attention output is lost
    assert small_computed == pytest.approx(plain, rel=1e-3)  # the scale absorbs the 2^-10 exactly
