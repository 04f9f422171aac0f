"""Qwen2.5-VL against transformers: image features equal the visual tower's, M-RoPE positions equal get_rope_index
at any chunk, and greedy tokens equal generate with the same images (one and two images of different sizes),
under 8-token chunks that cut image spans, a pool that forces preemption, and prefix hits (same image hits, another
image misses and gives its own tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.image_processors import load_processor
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError, load_model
from pagedserve.backend.worker.multimodal import EncoderRunner
from pagedserve.testing import QWEN_VL_IMAGE, make_tiny_qwen2_5_vl, tiny_image
from tests.support.vlm import Prompts, greedy_tokens, transformers_greedy, vlm_engine

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# 84x56 -> a 4x6 patch grid (6 tokens), 120x90 -> 6x8 (12), 200x150 -> 10x14 (35: windows cut at the edges).
IMAGES = [tiny_image(84, 56, seed=0), tiny_image(120, 90, seed=1), tiny_image(200, 150, seed=2)]
PROMPTS: list[tuple[str, list[Any]]] = [
    (f"Describe {QWEN_VL_IMAGE} in one line please.", [IMAGES[0]]),
    (f"Hello {QWEN_VL_IMAGE} and {QWEN_VL_IMAGE}: which is bigger?", [IMAGES[1], IMAGES[2]]),
    (f"{QWEN_VL_IMAGE}The quick brown fox", [IMAGES[2]]),
]


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def reference(qwen_path: Path) -> transformers.Qwen2_5_VLForConditionalGeneration:
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(qwen_path: Path, reference) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with its images."""
    return transformers_greedy(reference, load_processor(str(qwen_path)), PROMPTS, MAX_NEW)


_engine = vlm_engine


def _run(engine: LLMEngine, prompts: Prompts, prefix: str = "r") -> list[list[int]]:
    """Each prompt's greedy token ids, all queued at once."""
    return greedy_tokens(engine, prompts, GREEDY, prefix)


def test_processor_is_transformers_own_without_torchvision(qwen_path: Path) -> None:
    processor = load_processor(str(qwen_path))
    assert isinstance(processor, transformers.Qwen2_5_VLProcessor)
    out = processor(text=PROMPTS[1][0], images=PROMPTS[1][1], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 6, 8], [1, 10, 14]]
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 12 + 35


def test_image_features_equal_the_visual_tower(qwen_path: Path, reference) -> None:
    processor = load_processor(str(qwen_path))
    out = processor.image_processor(images=IMAGES, return_tensors="pt")
    grids = out["image_grid_thw"]
    ours = load_model(qwen_path, torch.float32, torch.device("cpu"), 256)
    chunks = out["pixel_values"].split(grids.prod(-1).tolist())
    with torch.no_grad():
        theirs = reference.model.get_image_features(out["pixel_values"], grids).pooler_output
        mine = ours.encode_images([{"pixel_values": c, "image_grid_thw": grids[i : i + 1]}
                                   for i, c in enumerate(chunks)])
    assert [m.shape[0] for m in mine] == [6, 12, 35]
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mine[0], mine[1][:6])


def test_mrope_positions_equal_get_rope_index_in_any_chunk(qwen_path: Path, reference) -> None:
    engine = _engine(qwen_path)
    prompt = f"Hello {QWEN_VL_IMAGE} and {QWEN_VL_IMAGE}: which {QWEN_VL_IMAGE} bigger?"
    processed = engine.image_processor.process(prompt, IMAGES)
    ids = torch.tensor([processed.token_ids])
    grids = torch.cat([image.data["image_grid_thw"] for image in processed.images])
    token_types = (ids == reference.config.image_token_id).long()
    positions, delta = reference.model.get_rope_index(ids, token_types, image_grid_thw=grids)
    model, n = engine.runner.model, ids.shape[1]
    assert torch.equal(model.mrope_positions(processed.images, 0, n), positions[:, 0])
    # Chunks of 5 give the same rows; tokens past the prompt (decode) are their index plus the rope delta.
    chunked = torch.cat([model.mrope_positions(processed.images, s, 5) for s in range(0, n + 10, 5)], dim=1)
    assert torch.equal(chunked[:, :n], positions[:, 0])
    assert torch.equal(chunked[:, n:], torch.arange(n, chunked.shape[1]).expand(3, -1) + int(delta))


def test_greedy_tokens_equal_transformers_for_one_and_two_images(qwen_path, expected):
    engine = _engine(qwen_path)
    assert _run(engine, PROMPTS) == expected
    assert _run(engine, [(PROMPTS[0][0], [IMAGES[1]])], prefix="o")[0] != expected[0]


def test_one_dimensional_positions_would_differ(qwen_path, expected, monkeypatch):
    """M-RoPE matters to these prompts: with every axis at the token's index the tokens change."""
    monkeypatch.setattr(EncoderRunner, "positions", lambda self, scheduled, positions: positions)
    assert _run(_engine(qwen_path), PROMPTS) != expected


def test_chunked_prefill_cutting_image_spans_keeps_the_tokens(qwen_path, expected):
    engine = _engine(qwen_path, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _run(engine, PROMPTS) == expected
    assert engine.runner.encoder.num_images_encoded == 3


def test_preemption_recomputes_positions_and_images(qwen_path, expected):
    engine = _engine(qwen_path, num_blocks=20, block_size=8, enable_prefix_caching=False, encoder_cache_size=64)
    got = _run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected


def test_prefix_cache_hits_with_the_same_image_and_misses_with_another(qwen_path, expected):
    engine = _engine(qwen_path, block_size=4)
    prompt = PROMPTS[1]
    assert _run(engine, [prompt], prefix="a")[0] == expected[1]
    hits = engine.scheduler.prefix_cache_hits
    assert _run(engine, [prompt], prefix="b")[0] == expected[1]
    assert engine.scheduler.prefix_cache_hits - hits >= 12 + 35  # both images' blocks were shared
    hits = engine.scheduler.prefix_cache_hits
    other = (prompt[0], [IMAGES[1], IMAGES[0]])  # the second image changed: only blocks before it hit
    got = _run(engine, [other], prefix="c")[0]
    offset = engine.image_processor.process(*other).images[1].offset
    assert engine.scheduler.prefix_cache_hits - hits == offset // 4 * 4
    assert got == _run(_engine(qwen_path), [other], prefix="d")[0] != expected[1]


def test_config_reads_hub_layout_and_mrope_sections(qwen_path: Path) -> None:
    raw = json.loads((qwen_path / "config.json").read_text())
    hub = {**raw.pop("text_config"), **raw}  # transformers 4's config.json: the text fields at the top level
    hub["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    hub.pop("rope_parameters", None)
    cfg = ModelArchConfig.from_dict(hub)
    assert (cfg.architecture, cfg.mrope_section, cfg.hidden_size, cfg.qkv_bias) == (
        "Qwen2_5_VLForConditionalGeneration", (2, 3, 3), 64, True)
    hub["rope_scaling"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        ModelArchConfig.from_dict(hub)


def test_qwen2_vl_features_and_chunked_greedy_tokens_equal_transformers(tmp_path: Path) -> None:
    """Qwen2-VL: the tower without windows (LayerNorms, a two-layer MLP), the same M-RoPE decoder."""
    path = make_tiny_qwen2_5_vl(tmp_path / "qwen2-vl", seed=3, qwen2=True)
    processor = load_processor(str(path))
    assert isinstance(processor, transformers.Qwen2VLProcessor)
    reference = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    out = processor.image_processor(images=IMAGES, return_tensors="pt")
    grids = out["image_grid_thw"]
    chunks = out["pixel_values"].split(grids.prod(-1).tolist())
    ours = load_model(path, torch.float32, torch.device("cpu"), 256)
    with torch.no_grad():
        theirs = reference.model.get_image_features(out["pixel_values"], grids).pooler_output
        mine = ours.encode_images([{"pixel_values": c, "image_grid_thw": grids[i : i + 1]}
                                   for i, c in enumerate(chunks)])
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    expected = []
    for prompt, images in PROMPTS:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        generated = reference.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        expected.append(generated[0, inputs["input_ids"].shape[1]:].tolist())
    assert _run(_engine(path, max_num_batched_tokens=8), PROMPTS) == expected


def test_n3_children_share_the_images(qwen_path, expected):
    engine = _engine(qwen_path)
    prompt, images = PROMPTS[1]
    engine.add_request("n3", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                       images=images)
    final = None
    while engine.has_unfinished_requests():
        final = next((out for out in engine.step() if out.finished), final)
    assert [list(c.token_ids) for c in final.outputs] == [expected[1]] * 3


def test_image_only_processor_takes_the_settings_its_class_names(tmp_path: Path) -> None:
    import inspect

    from pagedserve.backend.engine.image_processors import _settings

    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "SmolVLMProcessor", "image_seq_len": 64, "chat_template": "x", "unknown": 1}))
    parameters = inspect.signature(transformers.SmolVLMProcessor.__init__).parameters
    assert _settings(str(tmp_path), parameters) == {"image_seq_len": 64}
    assert _settings(str(tmp_path / "missing"), parameters) == {}


def test_checkpoint_names_of_the_hub_and_transformers_5(qwen_path: Path) -> None:
    from pagedserve.backend.model.qwen2_vl import Qwen2VLFamily

    cfg = ModelArchConfig.from_pretrained(qwen_path)
    family = Qwen2VLFamily(type(cfg), object)
    for name in ("model.layers.0.self_attn.k_proj.bias", "model.language_model.layers.0.self_attn.k_proj.bias"):
        placed = family.placement(name, cfg)
        assert placed.param == "layers.0.self_attn.qkv_proj.bias" and placed.selector == (slice(64, 96),)
    for name in ("visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert family.placement(name, cfg).param == "visual.blocks.0.attn.qkv.weight"
    assert family.placement("model.language_model.embed_tokens.weight", cfg).param == "embed_tokens.weight"
    assert family.placement("lm_head.weight", cfg).param == "lm_head.weight"
