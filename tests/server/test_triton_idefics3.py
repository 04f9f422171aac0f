"""Idefics3 / SmolVLM and Gemma 3 through tritonserver: the `llm` model's `image` input over gRPC streaming, one and
two images a prompt (Idefics3's each cut into tiles with text between; Gemma 3's tokens of an image attending to each
other), gives transformers' greedy tokens for the same images; the CLI's placeholder is the family's (`<image>`,
`<start_of_image>`)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.testing import make_tiny_idefics3, tiny_image
from pagedserve.testing_vlm import GEMMA3_IMAGE, make_tiny_gemma3_vl
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

MAX_NEW = 10
IMAGES = [tiny_image(84, 56, seed=0), tiny_image(30, 40, seed=1), tiny_image(200, 60, seed=2)]
PROMPTS = [("Describe <image> in one line please.", [IMAGES[0]]),
           ("Hello <image> and <image>: which is bigger?", [IMAGES[1], IMAGES[2]])]


# family -> (tiny maker, transformers class, its placeholder, whether its processor takes a list of images a text)
FAMILIES = {"idefics3": (make_tiny_idefics3, "Idefics3ForConditionalGeneration", "<image>", True),
            "gemma3": (make_tiny_gemma3_vl, "Gemma3ForConditionalGeneration", GEMMA3_IMAGE, False)}


def _png(image: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def vlm_path(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[family][0](tmp_path_factory.mktemp(f"tiny-{family}-server"), seed=1)


@pytest.fixture(scope="module")
def vlm_server(family, vlm_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64", "max_num_batched_tokens": "16"}
    with triton_running(vlm_path, tmp_path_factory.mktemp(f"{family}-server"), params, llm_only=True) as running:
        yield running


def test_image_input_gives_transformers_greedy_text(family, vlm_server, vlm_path):
    from pagedserve.client.commands import with_image_placeholders

    _, model_class, placeholder, nested = FAMILIES[family]
    processor = transformers.AutoProcessor.from_pretrained(vlm_path, local_files_only=True)
    model = getattr(transformers, model_class).from_pretrained(vlm_path, dtype=torch.float32).eval()
    texts = []
    for prompt, images in PROMPTS:
        prompt = prompt.replace("<image>", placeholder)
        inputs = processor(text=prompt, images=[images] if nested else images, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        request = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
                   "image": [_png(image) for image in images],
                   "sampling_parameters": {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}}
        result = vlm_server.grpc_stream("llm", request)
        assert result.error is None
        texts.append("".join(result.texts()))
        assert texts[-1] == expected
    assert texts[0] != texts[1]
    assert with_image_placeholders("Hi", 1, vlm_path) == f"{placeholder}\nHi"
    vlm_server.wait_idle()
