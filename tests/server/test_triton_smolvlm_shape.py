"""SmolVLM at a realistic shape through tritonserver: SmolVLM-256M's widths (a 576-wide Llama decoder with 9 query
and 3 KV heads; a 768-wide SigLIP over 512-pixel tiles of 16-pixel patches, pixel shuffle by 4: 64 tokens a tile)
and its image processor's sizes (resized to a longest edge of 2,048, so a 1,024 x 768 photo is 4 x 3 tiles and the
global view), random weights, two layers in each tower instead of 30 and 12 to keep the suite's time. The `llm`
model's image input gives transformers' greedy tokens; the OpenAI shim answers a data-URL chat with the image's 832 tokens counted.
"""

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

MAX_NEW = 8
PROMPT = "<image>Describe this photo."
TEXT = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rope_theta": 100000.0, "max_position_embeddings": 8192}
VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 12,
          "image_size": 512, "patch_size": 16}
TOKENS_A_TILE = 64


@pytest.fixture(scope="module")
def photo() -> object:
    return tiny_image(1024, 768, seed=5)


@pytest.fixture(scope="module")
def smolvlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("smolvlm-shape"), seed=2, text_sizes=TEXT,
                              vision_sizes=VISION, longest_edge=2048, scale_factor=4)


@pytest.fixture(scope="module")
def smolvlm_server(smolvlm_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "2048", "num_blocks": "256", "max_num_batched_tokens": "512"}
    with triton_running(smolvlm_path, tmp_path_factory.mktemp("smolvlm-server"), params) as running:
        yield running


def _png(image: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_photo_at_smolvlms_shape_gives_transformers_greedy_tokens(smolvlm_server, smolvlm_path, photo):
    processor = transformers.AutoProcessor.from_pretrained(smolvlm_path, local_files_only=True)
    inputs = processor(text=PROMPT, images=[[photo]], return_tensors="pt")
    image_tokens = int((inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<image>")).sum())
    assert image_tokens == 13 * TOKENS_A_TILE  # 4 x 3 tiles of 512 pixels and the global view
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(smolvlm_path, dtype=torch.float32).eval()
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    request = {"text_input": PROMPT, "stream": True, "exclude_input_in_output": True, "image": [_png(photo)],
               "sampling_parameters": {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}}
    result = smolvlm_server.grpc_stream("llm", request)
    assert result.error is None
    assert "".join(result.texts()) == expected
    smolvlm_server.wait_idle()


def test_the_openai_client_sends_the_photo_as_a_data_url(smolvlm_server, photo):
    import openai

    with smolvlm_server.openai_shim() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answer = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=MAX_NEW, temperature=0.0,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_png(photo)}"}},
                {"type": "text", "text": "Describe this photo."}]}])
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > 13 * TOKENS_A_TILE
    smolvlm_server.wait_idle()
