"""LLaVA through the engine against transformers' generate with the same images: greedy tokens equal for one
and two images a prompt, under chunked prefill that cuts an image's placeholder span, in a pool that forces
preemption, with n = 3; the prefix cache hits with the same image and misses with another; the encoder cache
encodes a repeated image once; bad image input is refused naming the field."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.vlm import Prompts, completions, vlm_engine

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

IMAGES = [tiny_image(40, 30, seed=0), tiny_image(20, 50, seed=1), tiny_image(64, 64, seed=2)]
PROMPTS: list[tuple[str, list[Any]]] = [
    ("Describe <image> in one line please.", [IMAGES[0]]),
    ("Hello <image> and <image>: which is bigger?", [IMAGES[1], IMAGES[2]]),
    ("<image>The quick brown fox", [IMAGES[2]]),
]


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"), "clip")


@pytest.fixture(scope="module")
def expected(llava_path: Path) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with its images."""
    processor = transformers.AutoProcessor.from_pretrained(llava_path, local_files_only=True)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava_path, dtype=torch.float32).eval()
    outs = []
    for prompt, images in PROMPTS:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return outs


@pytest.fixture(scope="module")
def llava_engine(llava_path: Path) -> LLMEngine:
    """One engine the refusal tests share (each leaves it idle with every block free)."""
    return _engine(llava_path)


_engine = vlm_engine


def _run(engine: LLMEngine, prompts: Prompts, params: SamplingParams = GREEDY,
         prefix: str = "r") -> list[list[list[int]]]:
    """Each prompt's completions' token ids (n of them), all queued at once."""
    return completions(engine, prompts, params, prefix)


def test_greedy_tokens_equal_transformers_for_one_and_two_images(llava_path, expected):
    engine = _engine(llava_path)
    got = _run(engine, PROMPTS)
    assert [g[0] for g in got] == expected
    # The images matter: the same text with another image continues differently.
    other = _run(engine, [(PROMPTS[0][0], [IMAGES[1]])], prefix="o")[0][0]
    assert other != expected[0]


def test_chunked_prefill_cutting_image_spans_keeps_the_tokens(llava_path, expected):
    engine = _engine(llava_path, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert [g[0] for g in _run(engine, PROMPTS)] == expected
    # Each distinct image was encoded once though its 16 placeholders took three chunks (two prompts share one).
    assert engine.runner.encoder.num_images_encoded == 3


def test_preemption_recomputes_images(llava_path, expected):
    engine = _engine(llava_path, num_blocks=10, block_size=8, enable_prefix_caching=False,
                     encoder_cache_size=32)
    got = _run(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    assert [g[0] for g in got] == expected


def test_n3_children_share_the_prompt_and_sample_their_own(llava_path, expected):
    engine = _engine(llava_path)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    (completions,) = _run(engine, PROMPTS[1:2], params)
    assert len(completions) == 3 and len({tuple(c) for c in completions}) > 1
    greedy3 = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    (completions,) = _run(engine, PROMPTS[1:2], greedy3, prefix="g")
    assert completions == [expected[1]] * 3


def test_prefix_cache_hits_with_the_same_image_and_misses_with_another(llava_path, expected):
    engine = _engine(llava_path, block_size=4)
    _run(engine, PROMPTS[:1], prefix="a")
    hits = engine.scheduler.prefix_cache_hits
    same = _run(engine, PROMPTS[:1], prefix="b")[0][0]
    assert same == expected[0]
    assert engine.scheduler.prefix_cache_hits - hits >= 16  # the image's blocks were shared
    hits = engine.scheduler.prefix_cache_hits
    other_prompt = (PROMPTS[0][0], [IMAGES[1]])
    other = _run(engine, [other_prompt], prefix="c")[0][0]
    # Only the blocks of text before the image hit.
    offset = engine.image_processor.process(*other_prompt).images[0].offset
    assert engine.scheduler.prefix_cache_hits - hits == offset // 4 * 4
    fresh = _run(_engine(llava_path), [other_prompt], prefix="d")[0][0]
    assert other == fresh != expected[0]


def test_encoder_cache_encodes_a_repeated_image_once(llava_path, expected):
    engine = _engine(llava_path, enable_prefix_caching=False)
    encoder = engine.runner.encoder
    assert _run(engine, PROMPTS[:1], prefix="a")[0][0] == expected[0]
    assert encoder.num_images_encoded == 1
    assert _run(engine, PROMPTS[:1], prefix="b")[0][0] == expected[0]
    assert encoder.num_images_encoded == 1  # the second request's image came from the cache
    _run(engine, [(PROMPTS[0][0], [IMAGES[1]])], prefix="c")
    assert encoder.num_images_encoded == 2


def test_image_bytes_equal_the_pil_image(llava_path, expected):
    engine = _engine(llava_path)
    buffer = io.BytesIO()
    IMAGES[0].save(buffer, format="PNG")
    assert _run(engine, [(PROMPTS[0][0], [buffer.getvalue()])])[0][0] == expected[0]


@pytest.mark.parametrize(("prompt", "images", "field", "words"), [
    ("Describe <image>", [b"not an image"], "images", "not a readable image"),
    ("Describe <image>", [b"\x89PNG\r\n\x1a\n" + b"\0" * 20], "images", "not a readable image"),
    ("Describe <image> and <image>", [IMAGES[0]], "images", "2 image placeholders"),
    ("Describe", [IMAGES[0]], "images", "0 image placeholders"),
    ("Describe <image>", [42], "images", "must be image file bytes or a PIL image"),
    ("Describe " + "<image>" * 20, [IMAGES[0]] * 20, "prompt", "max_model_len"),
])
def test_bad_image_input_is_refused_naming_the_field(llava_engine, prompt, images, field, words):
    engine = llava_engine
    with pytest.raises(InvalidRequestError, match=words) as info:
        engine.add_request("bad", prompt, GREEDY, images=images)
    assert info.value.field == field
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks


def test_truncated_image_file_is_refused(llava_engine):
    buffer = io.BytesIO()
    IMAGES[2].save(buffer, format="PNG")
    engine = llava_engine
    with pytest.raises(InvalidRequestError, match="images\\[0\\]") as info:
        engine.add_request("bad", "Describe <image>", GREEDY, images=[buffer.getvalue()[:-40]])
    assert info.value.field == "images"


def test_images_on_a_text_only_model_are_refused(tiny_llama_path):
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), dtype="float32", device="cpu", max_model_len=128)
    with pytest.raises(InvalidRequestError, match="takes no images") as info:
        engine.add_request("bad", "Describe <image>", GREEDY, images=[IMAGES[0]])
    assert info.value.field == "images"


def test_siglip_tower_with_a_qwen2_language_model_equals_transformers(tmp_path):
    path = make_tiny_llava(tmp_path / "llava-siglip-qwen2", "siglip", text_arch="qwen2", vision_feature_layer=-1,
                           seed=5)
    processor = transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    prompt, images = "Hello <image><image>: which is bigger?", PROMPTS[1][1]  # side by side: one run of tokens
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    engine = _engine(path, max_num_batched_tokens=8)
    assert _run(engine, [(prompt, images)])[0][0] == expected


@pytest.mark.parametrize("num_blocks", [None, 20])
def test_beams_with_images_equal_transformers_num_beams(llava_path, num_blocks):
    """Beams over an image prompt; two such searches in a 20-block pool preempt each other's beams, which
    recompute with the image."""
    prompt, images = PROMPTS[0]
    processor = transformers.AutoProcessor.from_pretrained(llava_path, local_files_only=True)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava_path, dtype=torch.float32).eval()
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, num_beams=3,
                         num_return_sequences=3, eos_token_id=None, pad_token_id=0, length_penalty=1.0)
    expected = [seq[inputs["input_ids"].shape[1]:].tolist() for seq in out]
    settings = {} if num_blocks is None else {"num_blocks": num_blocks, "block_size": 4,
                                              "enable_prefix_caching": False}
    engine = _engine(llava_path, **settings)
    params = SamplingParams(beam_width=3, n=3, max_tokens=MAX_NEW, ignore_eos=True, length_penalty=1.0)
    assert _run(engine, [(prompt, images)] * 2, params) == [expected] * 2
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks is not None)
