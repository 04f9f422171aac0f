"""Qwen2.5-VL through tritonserver: the `llm` model's `image` input over gRPC streaming, one and two images of
different sizes a prompt, gives transformers' greedy tokens for the same images (the processor built without
torchvision inside the server too); the shim's image_url part renders Qwen's placeholder and gives the engine's
text."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.image_processors import load_processor
from pagedserve.testing import QWEN_VL_IMAGE, make_tiny_qwen2_5_vl, tiny_image
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

MAX_NEW = 10
IMAGES = [tiny_image(84, 56, seed=0), tiny_image(120, 90, seed=1), tiny_image(200, 150, seed=2)]
PROMPTS = [(f"Describe {QWEN_VL_IMAGE} in one line please.", [IMAGES[0]]),
           (f"Hello {QWEN_VL_IMAGE} and {QWEN_VL_IMAGE}: which is bigger?", [IMAGES[1], IMAGES[2]])]


def _png(image: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen-vl-server"), seed=1)


@pytest.fixture(scope="module")
def qwen_server(qwen_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64", "max_num_batched_tokens": "16"}
    with triton_running(qwen_path, tmp_path_factory.mktemp("qwen-vl-server"), params, llm_only=True) as running:
        yield running


def test_image_input_gives_transformers_greedy_text(qwen_server, qwen_path):
    processor = load_processor(str(qwen_path))
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_path, dtype=torch.float32).eval()
    texts = []
    for prompt, images in PROMPTS:
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        request = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
                   "image": [_png(image) for image in images],
                   "sampling_parameters": {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}}
        result = qwen_server.grpc_stream("llm", request)
        assert result.error is None
        texts.append("".join(result.texts()))
        assert texts[-1] == expected
    assert texts[0] != texts[1]
    qwen_server.wait_idle()


def test_openai_chat_image_url_part_renders_qwens_placeholder(qwen_server, qwen_path):
    import openai

    from tests.support.engines import cpu_engine

    url = "data:image/png;base64," + _png(IMAGES[1])
    content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": " in one line please."}]
    with qwen_server.openai_shim() as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=MAX_NEW,
                                               temperature=0.0, messages=[{"role": "user", "content": content}],
                                               extra_body={"ignore_eos": True})
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(qwen_path), local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe {QWEN_VL_IMAGE} in one line please."}], tokenize=False,
        add_generation_prompt=True)
    engine = cpu_engine(qwen_path, num_blocks=32)
    engine.add_request("chat", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                       images=[IMAGES[1]], add_special_tokens=False)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.finished]
    assert reply.choices[0].message.content == outputs[0].outputs[0].text
    assert reply.usage.prompt_tokens == len(outputs[0].prompt_token_ids) > 12
    qwen_server.wait_idle()
