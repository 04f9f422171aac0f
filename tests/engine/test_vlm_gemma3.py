"""Gemma 3 (Gemma3ForConditionalGeneration) against transformers: image features equal get_image_features, and greedy
tokens equal generate with the same images (one and two images of different sizes; each image's tokens attend to
each other, in the sliding layers within the window), under chunks whose boundary moves to an image's start, a
pool that forces preemption, prefix hits (one ending inside an image's run; another image misses and gives its
own tokens), many requests sharing a 12-token budget, and n = 3; the encoder cache encodes an image two prompts
share once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.multimodal import ImageInput, StepEncoderCache, end_outside_runs, image_runs
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError, load_model
from pagedserve.backend.model.gemma3_vl import Gemma3VLArchConfig, Gemma3VLFamily
from pagedserve.testing import tiny_image
from pagedserve.testing_vlm import GEMMA3_IMAGE, make_tiny_gemma3_vl
from tests.support.vlm import Prompts, completions, greedy_tokens, transformers_greedy, vlm_engine

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGES = [tiny_image(30, 40, seed=0), tiny_image(80, 20, seed=1), tiny_image(200, 60, seed=2)]  # each to 42x42
RUN = 9  # image tokens an image (3x3 pooled from 6x6 patches), between its begin / end markers
PROMPTS: list[tuple[str, list[Any]]] = [
    (f"Describe {GEMMA3_IMAGE} in one line please.", [IMAGES[0]]),  # its run: positions 10 .. 18
    (f"Hello {GEMMA3_IMAGE} and {GEMMA3_IMAGE}: which is bigger?", [IMAGES[1], IMAGES[2]]),
    (f"{GEMMA3_IMAGE}The quick brown fox", [IMAGES[2]]),
]


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl"))


@pytest.fixture(scope="module")
def reference(gemma3_path: Path) -> transformers.Gemma3ForConditionalGeneration:
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(gemma3_path: Path) -> Any:
    return transformers.AutoProcessor.from_pretrained(gemma3_path, local_files_only=True)


@pytest.fixture(scope="module")
def expected(reference, processor) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with its images (token_type_ids: images bidirectional)."""
    return transformers_greedy(reference, processor, PROMPTS, MAX_NEW)


def _run(engine: LLMEngine, prompts: Prompts, prefix: str = "r") -> list[list[int]]:
    return greedy_tokens(engine, prompts, GREEDY, prefix)


def _record_chunks(engine: LLMEngine) -> list[tuple[str, int, int]]:
    """(request id, first position, end) of every chunk the engine's scheduler plans from now on."""
    chunks: list[tuple[str, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend((s.request.request_id, s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)
                      for s in out.scheduled)
        return out

    engine.scheduler.schedule = recording
    return chunks


def test_image_features_equal_get_image_features(gemma3_path: Path, reference, processor) -> None:
    out = processor(text=f"{GEMMA3_IMAGE} {GEMMA3_IMAGE}", images=IMAGES[:2], return_tensors="pt")
    ours = load_model(gemma3_path, torch.float32, torch.device("cpu"), 256)
    with torch.no_grad():
        theirs = reference.model.get_image_features(out["pixel_values"]).pooler_output
        mine = ours.encode_images([{"pixel_values": out["pixel_values"][i : i + 1]} for i in range(2)])
    assert [m.shape for m in mine] == [(RUN, 64)] * 2
    torch.testing.assert_close(torch.stack(mine), theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mine[0], mine[1])


def test_greedy_tokens_equal_transformers_for_one_and_two_images(gemma3_path, reference, processor, expected):
    engine = vlm_engine(gemma3_path)
    assert _run(engine, PROMPTS) == expected
    assert engine.runner.encoder.num_images_encoded == 3  # the third prompt's image came from the cache
    # The bidirectional image runs matter here: transformers attending causally (no token_type_ids) differs.
    causal = []
    for prompt, images in PROMPTS:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        del inputs["token_type_ids"]
        out = reference.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        causal.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    assert causal != expected
    assert _run(engine, [(PROMPTS[0][0], [IMAGES[1]])], prefix="o")[0] != expected[0]


def test_chunk_ends_move_to_the_image_start_and_keep_the_tokens(gemma3_path, expected):
    engine = vlm_engine(gemma3_path, max_num_batched_tokens=12, enable_prefix_caching=False)
    chunks = _record_chunks(engine)
    assert _run(engine, PROMPTS) == expected
    runs = {f"r{i}": image_runs(engine.image_processor.process(*prompt).images) for i, prompt in enumerate(PROMPTS)}
    assert ("r0", 0, 10) in chunks  # 12 tokens would have ended inside the run at 10 .. 18
    assert not [(rid, end) for rid, _, end in chunks for lo, hi in runs[rid] if lo < end < hi]


def test_an_image_run_longer_than_a_step_is_refused_naming_images(gemma3_path):
    engine = vlm_engine(gemma3_path, max_num_batched_tokens=RUN - 1)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens") as info:
        engine.add_request("long", PROMPTS[0][0], GREEDY, images=PROMPTS[0][1])
    assert info.value.field == "images"
    assert not engine.has_unfinished_requests()


def test_preemption_recomputes_whole_runs(gemma3_path, expected):
    engine = vlm_engine(gemma3_path, num_blocks=10, block_size=8, enable_prefix_caching=False)
    got = _run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    assert got == expected


def test_prefix_hit_inside_a_run_and_another_image_misses(gemma3_path, reference, processor):
    prompt = (f"Look at {GEMMA3_IMAGE}", [IMAGES[0]])  # 20 tokens, its run 9 .. 17
    other = (prompt[0], [IMAGES[2]])
    want = transformers_greedy(reference, processor, [prompt, other], MAX_NEW)
    engine = vlm_engine(gemma3_path, block_size=8, max_num_batched_tokens=12)
    assert _run(engine, [prompt], prefix="a")[0] == want[0]
    chunks = _record_chunks(engine)
    hits = engine.scheduler.prefix_cache_hits
    assert _run(engine, [prompt], prefix="b")[0] == want[0]
    assert engine.scheduler.prefix_cache_hits - hits == 16  # two blocks: the second ends inside the run
    assert chunks[0] == ("b0", 16, 20)  # from inside the run to its end and past
    hits = engine.scheduler.prefix_cache_hits
    assert _run(engine, [other], prefix="c")[0] == want[1] != want[0]
    assert engine.scheduler.prefix_cache_hits - hits == 8  # the block before the image only


def test_n3_children_share_the_images(gemma3_path, expected):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert completions(vlm_engine(gemma3_path), PROMPTS[1:2], params)[0] == [expected[1]] * 3


def test_config_and_checkpoint_names(gemma3_path: Path) -> None:
    cfg = ModelArchConfig.from_pretrained(gemma3_path)
    assert isinstance(cfg, Gemma3VLArchConfig)
    assert (cfg.architecture, cfg.mm_tokens_per_image, cfg.hidden_size, cfg.sliding_window) == (
        "Gemma3ForConditionalGeneration", RUN, 64, 8)
    assert cfg.sliding_layers == (True, False, True, False) and cfg.local_rope_theta == 10_000.0
    family = Gemma3VLFamily(type(cfg), object)
    for name, param, selector in [
        ("language_model.model.layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight",
         (slice(64, 96),)),
        ("model.language_model.layers.1.mlp.up_proj.weight", "layers.1.mlp.gate_up_proj.weight",
         (slice(128, 256),)),
        ("language_model.lm_head.weight", "lm_head.weight", None),
        ("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
         "vision_tower.encoder.layers.0.self_attn.q_proj.weight", None),
        ("model.vision_tower.vision_model.post_layernorm.weight", "vision_tower.post_layernorm.weight", None),
        ("multi_modal_projector.mm_input_projection_weight", "multi_modal_projector.mm_input_projection_weight",
         None),
    ]:
        placed = family.placement(name, cfg)
        assert (placed.param, placed.selector) == (param, selector), name
    hub = json.loads((gemma3_path / "config.json").read_text())
    hub["text_config"].pop("eos_token_id")
    assert ModelArchConfig.from_dict({**hub, "eos_token_id": [1, 106]}).eos_token_ids == (1, 106)
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"model_type": "llama"},
           "vision_config": {}}
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        ModelArchConfig.from_dict(raw)


def _image(offset: int, length: int, name: str = "x") -> ImageInput:
    return ImageInput(name, offset, length, None)


def test_chunks_end_outside_runs() -> None:
    images = [_image(4, 3, "a"), _image(7, 2, "b"), _image(12, 3, "c")]  # a and b side by side: one run 4 .. 8
    assert image_runs(images) == [(4, 9), (12, 15)]
    assert [end_outside_runs(images, 0, n) for n in (4, 5, 8, 9, 10, 13, 15)] == [4, 4, 4, 9, 10, 12, 15]
    assert end_outside_runs(images, 5, 2) == 0  # started inside a run (a prefix hit): to its end or nothing
    assert end_outside_runs(images, 5, 4) == 4
    cache = StepEncoderCache(capacity=64, budget=64)
    assert cache.plan(images, 0, 6) == 6  # off: a chunk may end anywhere
    cache.whole_runs = True
    assert cache.plan(images, 0, 6) == 4


def test_the_shim_and_cli_placeholder_is_the_processors(gemma3_path, processor) -> None:
    from pagedserve.client.openai.images import image_placeholder

    assert image_placeholder(str(gemma3_path)) == processor.image_token == GEMMA3_IMAGE


def test_many_requests_share_a_small_budget_with_prefix_hits_inside_runs(gemma3_path, reference, processor,
                                                                         expected):
    prompts = [(f"Look at {GEMMA3_IMAGE}", [IMAGES[i % 2]]) for i in range(6)] + PROMPTS
    want = transformers_greedy(reference, processor, prompts[:2], MAX_NEW)
    engine = vlm_engine(gemma3_path, block_size=8, max_num_batched_tokens=12)
    chunks = _record_chunks(engine)
    got = _run(engine, prompts)
    assert got[:6] == want * 3 and got[6:] == expected
    runs = {f"r{i}": image_runs(engine.image_processor.process(*prompt).images) for i, prompt in enumerate(prompts)}
    assert not [(rid, end) for rid, _, end in chunks for lo, hi in runs[rid] if lo < end < hi]
    assert [(rid, start) for rid, start, _ in chunks if start == 16 and rid in ("r2", "r3", "r4", "r5")]
