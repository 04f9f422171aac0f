"""Idefics3 / SmolVLM against transformers: tile features equal get_image_features, and greedy tokens equal
generate with the same images (one and two images of different sizes, each cut into tiles with text between),
under 8-token chunks that cut tiles, a pool that forces preemption, and prefix hits (same image hits, another image
misses and gives its own tokens); the encoder cache encodes a tile two prompts share once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model import ModelArchConfig, load_model
from pagedserve.backend.model.idefics3 import Idefics3Family
from pagedserve.testing import make_tiny_idefics3, tiny_image
from tests.support.vlm import Prompts, greedy_tokens, transformers_greedy, vlm_engine

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# 84x56 -> 2x2 tiles + the global view (5 tiles), 30x40 -> 2x2 + 1, 200x60 -> 1x2 + 1; 4 tokens a tile.
IMAGES = [tiny_image(84, 56, seed=0), tiny_image(30, 40, seed=1), tiny_image(200, 60, seed=2)]
PROMPTS: list[tuple[str, list[Any]]] = [
    ("Describe <image> in one line please.", [IMAGES[0]]),
    ("Hello <image> and <image>: which is bigger?", [IMAGES[1], IMAGES[2]]),
    ("<image>The quick brown fox", [IMAGES[2]]),
]


@pytest.fixture(scope="module")
def idefics_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def reference(idefics_path: Path) -> transformers.Idefics3ForConditionalGeneration:
    return transformers.Idefics3ForConditionalGeneration.from_pretrained(idefics_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(idefics_path: Path, reference) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with its images."""
    return transformers_greedy(reference, transformers.AutoProcessor.from_pretrained(idefics_path, local_files_only=True), PROMPTS, MAX_NEW, nested=True)


_engine = vlm_engine


def _run(engine: LLMEngine, prompts: Prompts, prefix: str = "r") -> list[list[int]]:
    """Each prompt's greedy token ids, all queued at once."""
    return greedy_tokens(engine, prompts, GREEDY, prefix)


def test_tile_features_equal_get_image_features(idefics_path: Path, reference) -> None:
    processor = transformers.AutoProcessor.from_pretrained(idefics_path, local_files_only=True)
    out = processor(text="<image> <image>", images=[IMAGES[:2]], return_tensors="pt")
    pixels = out["pixel_values"]
    ours = load_model(idefics_path, torch.float32, torch.device("cpu"), 256)
    with torch.no_grad():
        theirs = reference.model.get_image_features(pixels, out["pixel_attention_mask"]).pooler_output[0]
        mine = ours.encode_images([{"pixel_values": pixels[0, i : i + 1]} for i in range(pixels.shape[1])])
    assert [m.shape for m in mine] == [(4, 64)] * 10
    torch.testing.assert_close(torch.cat(mine), theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mine[0], mine[1])


def test_each_tile_is_an_image_input_of_its_own_run(idefics_path: Path) -> None:
    engine = _engine(idefics_path)
    processed = engine.image_processor.process(*PROMPTS[1])
    assert [image.length for image in processed.images] == [4] * 8
    assert all(processed.token_ids[image.offset - 1] != processed.token_ids[image.offset]
               for image in processed.images)  # a tag or marker before each tile's run
    assert len({image.content_hash for image in processed.images}) == 8


def test_greedy_tokens_equal_transformers_for_one_and_two_images(idefics_path, expected):
    engine = _engine(idefics_path)
    assert _run(engine, PROMPTS) == expected
    assert engine.runner.encoder.num_images_encoded == 5 + 5 + 3  # the third prompt's tiles came from the cache
    assert _run(engine, [(PROMPTS[0][0], [IMAGES[1]])], prefix="o")[0] != expected[0]


def test_chunked_prefill_cutting_tiles_keeps_the_tokens(idefics_path, expected):
    engine = _engine(idefics_path, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _run(engine, PROMPTS) == expected


def test_preemption_recomputes_tiles(idefics_path, expected):
    engine = _engine(idefics_path, num_blocks=16, block_size=8, enable_prefix_caching=False, encoder_cache_size=64)
    got = _run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected


def test_prefix_cache_hits_with_the_same_image_and_misses_with_another(idefics_path, expected):
    engine = _engine(idefics_path, block_size=4)
    assert _run(engine, PROMPTS[:1], prefix="a")[0] == expected[0]
    hits = engine.scheduler.prefix_cache_hits
    assert _run(engine, PROMPTS[:1], prefix="b")[0] == expected[0]
    assert engine.scheduler.prefix_cache_hits - hits >= 5 * 4  # the tiles' blocks were shared
    hits = engine.scheduler.prefix_cache_hits
    other = (PROMPTS[0][0], [IMAGES[1]])
    got = _run(engine, [other], prefix="c")[0]
    offset = engine.image_processor.process(*other).images[0].offset
    assert engine.scheduler.prefix_cache_hits - hits == offset // 4 * 4
    assert got == _run(_engine(idefics_path), [other], prefix="d")[0] != expected[0]


def test_placeholder_mismatch_is_refused_naming_images(idefics_path):
    engine = _engine(idefics_path)
    with pytest.raises(InvalidRequestError, match="2 image placeholders") as info:
        engine.add_request("bad", "Describe <image> and <image>", GREEDY, images=[IMAGES[0]])
    assert info.value.field == "images"
    assert not engine.has_unfinished_requests()


def test_config_and_checkpoint_names(idefics_path: Path) -> None:
    cfg = ModelArchConfig.from_pretrained(idefics_path)
    assert (cfg.architecture, cfg.scale_factor, cfg.hidden_size, cfg.qkv_bias) == (
        "Idefics3ForConditionalGeneration", 2, 64, False)
    family = Idefics3Family(type(cfg), object)
    placed = family.placement("model.text_model.layers.0.self_attn.k_proj.weight", cfg)
    assert placed.param == "layers.0.self_attn.qkv_proj.weight" and placed.selector == (slice(64, 96),)
    assert family.placement("model.connector.modality_projection.proj.weight", cfg).param == (
        "connector.modality_projection.proj.weight")
    assert family.placement("model.vision_model.post_layernorm.weight", cfg).param == "vision_model.post_layernorm.weight"


def test_n3_children_share_the_images(idefics_path, expected):
    engine = _engine(idefics_path)
    prompt, images = PROMPTS[1]
    engine.add_request("n3", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                       images=images)
    final = None
    while engine.has_unfinished_requests():
        final = next((out for out in engine.step() if out.finished), final)
    assert [list(c.token_ids) for c in final.outputs] == [expected[1]] * 3


def test_a_tile_with_padding_is_refused_naming_images():
    from pagedserve.backend.engine.image_processors import per_image

    pixels, mask = torch.ones(1, 2, 3, 4, 4), torch.ones(1, 2, 4, 4, dtype=torch.long)
    assert [t["pixel_values"].shape for t in per_image({"pixel_values": pixels, "pixel_attention_mask": mask}, 1)] == [
        (1, 3, 4, 4)] * 2
    mask[0, 1, :, 3] = 0
    with pytest.raises(InvalidRequestError, match="padding") as info:
        per_image({"pixel_values": pixels, "pixel_attention_mask": mask}, 1)
    assert info.value.field == "images"
