"""Adapter loading and the engine's LoRA API: bad adapters are refused naming the adapter and the reason while the
engine and its other adapters go on; names, removal and lora_name are checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.backend.core.config import LoRAConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model import ModelArchConfig
from pagedserve.backend.model.lora import LoRAAdapterError, load_lora_adapter
from pagedserve.testing import make_lora_adapter, make_tiny_model
from tests.support.engines import cpu_engine, greedy


@pytest.fixture(scope="module")
def good(tiny_llama_path, tmp_path_factory) -> Path:
    return make_lora_adapter(tiny_llama_path, tmp_path_factory.mktemp("good") / "a", rank=8, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_llama_path, good):
    return cpu_engine(tiny_llama_path, enable_lora=True, max_loras=2, max_lora_rank=16, num_blocks=32,
                      lora_modules={"good": str(good)})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> Path:
    file = folder / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    return folder


def _bad_adapters(tiny_llama_path: Path, good: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (folder, words the refusal must hold)."""
    corrupt = _copy(good, root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    no_weights = _copy(good, root / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    other_base = make_tiny_model(root / "other-base", hidden_size=32, intermediate_size=64)
    return {
        "missing": (root / "does-not-exist", "no such folder"),
        "corrupt": (corrupt, "cannot be read"),
        "no-weights": (no_weights, "adapter_model.safetensors is missing"),
        "too-big": (make_lora_adapter(tiny_llama_path, root / "rank32", rank=32), "rank 32 is over max_lora_rank (16)"),
        "wrong-base": (make_lora_adapter(other_base, root / "wrong-base"), "another model"),
        "to-save": (_edit_config(_copy(good, root / "to-save"), modules_to_save=["lm_head"]), "modules_to_save"),
        "bias": (_edit_config(_copy(good, root / "bias"), bias="all"), "bias 'all'"),
        "dora": (_edit_config(_copy(good, root / "dora"), use_dora=True), "DoRA"),
        "embedding": (_edit_config(_copy(good, root / "embedding"), target_modules=["embed_tokens", "q_proj"]),
                      "target modules ['embed_tokens']"),
    }


def test_bad_adapters_are_refused_naming_them_and_the_engine_goes_on(engine, tiny_llama_path, good, tmp_path):
    base_out = engine.generate([[5, 6, 7, 8]], greedy(4))[0].outputs[0].token_ids
    good_out = engine.generate([[5, 6, 7, 8]], greedy(4, lora_name="good"))[0].outputs[0].token_ids
    for name, (folder, reason) in _bad_adapters(tiny_llama_path, good, tmp_path).items():
        with pytest.raises(InvalidRequestError) as info:
            engine.add_lora(name, str(folder))
        assert info.value.field == "lora"
        assert f"LoRA adapter {name!r}" in str(info.value) and reason in str(info.value), str(info.value)
    assert engine.list_loras() == {"good": str(good)}
    assert engine.generate([[5, 6, 7, 8]], greedy(4, lora_name="good"))[0].outputs[0].token_ids == good_out
    assert engine.generate([[5, 6, 7, 8]], greedy(4))[0].outputs[0].token_ids == base_out
    assert good_out != base_out


def test_add_remove_and_list_follow_names(engine, good):
    engine.add_lora("second", str(good))
    assert list(engine.list_loras()) == ["good", "second"]
    with pytest.raises(InvalidRequestError, match="'second' is already loaded") as info:
        engine.add_lora("second", str(good))
    assert info.value.field == "lora"
    engine.add_request("busy", None, greedy(4, lora_name="second"), prompt_token_ids=[5, 6, 7])
    with pytest.raises(InvalidRequestError, match="'second' is in use"):
        engine.remove_lora("second")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("second")
    assert list(engine.list_loras()) == ["good"]
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'second'"):
        engine.remove_lora("second")
    with pytest.raises(InvalidRequestError, match="'second'") as info:
        engine.add_request("gone", None, greedy(4, lora_name="second"), prompt_token_ids=[5, 6, 7])
    assert info.value.field == "lora_name"


def test_stats_name_running_and_waiting_adapters(engine, good):
    engine.add_lora("x1", str(good))
    engine.add_lora("x2", str(good))
    try:
        for i, name in enumerate(["x1", "x2", None]):
            engine.add_request(f"s{i}", None, greedy(3, lora_name=name), prompt_token_ids=[5, 6, 7])
        stats = engine.get_stats()
        assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_lora) == ([], ["x1", "x2"], 2)
        engine.step()  # one adapter that is not resident is admitted per step: x2 waits for the next
        stats = engine.get_stats()
        assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (["x1"], ["x2"])
        assert stats.num_running == 2
        engine.step()
        assert engine.get_stats().running_lora_adapters == ["x1", "x2"]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.get_stats().running_lora_adapters == []
    finally:
        engine.remove_lora("x1")
        engine.remove_lora("x2")


def test_lora_name_is_refused_without_lora(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, num_blocks=16)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled") as info:
        engine.add_request("r", None, greedy(2, lora_name="x"), prompt_token_ids=[5, 6])
    assert info.value.field == "lora_name"
    assert engine.get_stats().max_lora == 0
    with pytest.raises(InvalidRequestError) as info:
        engine.add_lora("x", "/nowhere")
    assert info.value.field == "enable_lora"


def test_lora_options_are_checked_by_name(tiny_llama_path, good):
    for options, field in [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
                           ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"), ({"enable_lora": "yes"},
                                                                                       "enable_lora")]:
        with pytest.raises(InvalidRequestError) as info:
            LoRAConfig(**options)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="'bad'"):
        cpu_engine(tiny_llama_path, enable_lora=True, num_blocks=8, lora_modules={"bad": "/nowhere"})
    assert SamplingParams.from_dict({"lora_name": "good"}).lora_name == "good"
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        SamplingParams.from_dict({"lora_int_id": 3})
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(lora_name="")
    assert info.value.field == "lora_name"


def test_a_fused_qkv_target_is_its_parts_with_one_a(tiny_llama_path, tmp_path):
    arch = ModelArchConfig.from_pretrained(tiny_llama_path)
    q, kv, h = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    a, b = torch.randn(4, h), torch.randn(q + 2 * kv, 4)
    save_file({"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight": b},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}))
    adapter = load_lora_adapter("phi", tmp_path, arch, 16)
    delta = torch.cat([adapter.weights[(0, part)][1] @ adapter.weights[(0, part)][0]
                       for part in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(delta, 2.0 * b @ a)
    with pytest.raises(LoRAAdapterError, match="rank 4 is over max_lora_rank"):
        load_lora_adapter("phi", tmp_path, arch, 2)
