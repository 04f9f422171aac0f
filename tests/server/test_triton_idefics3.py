"""Idefics3 / SmolVLM through tritonserver: the `llm` model's `image` input over gRPC streaming, one and two images
a prompt (each cut into tiles with text between), gives transformers' greedy tokens for the same images; the CLI's
placeholder for this family is `<image>`."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.testing import make_tiny_idefics3, tiny_image
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

MAX_NEW = 10
IMAGES = [tiny_image(84, 56, seed=0), tiny_image(30, 40, seed=1), tiny_image(200, 60, seed=2)]
PROMPTS = [("Describe <image> in one line please.", [IMAGES[0]]),
           ("Hello <image> and <image>: which is bigger?", [IMAGES[1], IMAGES[2]])]


def _png(image: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def idefics_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3-server"), seed=1)


@pytest.fixture(scope="module")
def idefics_server(idefics_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64", "max_num_batched_tokens": "16"}
    with triton_running(idefics_path, tmp_path_factory.mktemp("idefics3-server"), params, llm_only=True) as running:
        yield running


def test_image_input_gives_transformers_greedy_text(idefics_server, idefics_path):
    from pagedserve.client.commands import with_image_placeholders

    processor = transformers.AutoProcessor.from_pretrained(idefics_path, local_files_only=True)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(idefics_path, dtype=torch.float32).eval()
    texts = []
    for prompt, images in PROMPTS:
        inputs = processor(text=prompt, images=[images], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        request = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
                   "image": [_png(image) for image in images],
                   "sampling_parameters": {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}}
        result = idefics_server.grpc_stream("llm", request)
        assert result.error is None
        texts.append("".join(result.texts()))
        assert texts[-1] == expected
    assert texts[0] != texts[1]
    assert with_image_placeholders("Hi", 1, idefics_path) == "<image>\nHi"
    idefics_server.wait_idle()
