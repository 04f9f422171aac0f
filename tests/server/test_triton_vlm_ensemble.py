"""A vision-language model through the ensemble with TensorRT-LLM's multimodal inputs: `image_bytes_input` (uint8
pixels, [batch, images, H, W, C] or [batch, images, C, H, W]) and `image_url_input` (data: URLs) give the llm
model's text for the same image file; bad images, http(s) URLs and images on the preprocessing step are refused
naming the input, and the server serves on."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

PROMPT = "Describe <image> in one line please."
MAX_TOKENS = 10


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    tiny_image(40, 30, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(**inputs: np.ndarray) -> dict[str, np.ndarray]:
    """One TensorRT-LLM ensemble row, greedy, min_length = max_tokens (the tiny model's eos cannot end it)."""
    return {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
            "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32),
            "min_length": np.array([[MAX_TOKENS]], dtype=np.int32),
            "temperature": np.array([[0.0]], dtype=np.float32),
            "exclude_input_in_output": np.array([[True]]), **inputs}


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _url(png: bytes) -> np.ndarray:
    return np.array([[("data:image/png;base64," + base64.b64encode(png).decode()).encode()]], dtype=np.object_)


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    path: Path = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-ensemble"), "clip", seed=3)
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64"}
    with triton_running(path, tmp_path_factory.mktemp("llava-ensemble-server"), params) as running:
        yield running


def _text(server: RunningTriton, model: str, values: dict) -> str:
    result = server.grpc_stream(model, values)
    assert result.error is None, result.error
    return "".join(result.texts())


def test_ensemble_image_inputs_give_the_llm_models_text_for_that_image(llava_server):
    texts = []
    for png in (_png(0), _png(1)):
        llm = _text(llava_server, "llm", {
            "text_input": PROMPT, "image": [base64.b64encode(png).decode()], "exclude_input_in_output": True,
            "sampling_parameters": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS}})
        hwc = _pixels(png)[None, None]
        chw = np.ascontiguousarray(np.moveaxis(hwc, -1, 2))
        assert _text(llava_server, "ensemble", _row(image_bytes_input=hwc)) == llm
        assert _text(llava_server, "ensemble", _row(image_bytes_input=chw, stream=np.array([[True]]))) == llm
        assert _text(llava_server, "ensemble", _row(image_url_input=_url(png))) == llm
        texts.append(llm)
    assert texts[0] != texts[1]  # the image, not only the text, decides the output
    llava_server.wait_idle()


@pytest.mark.parametrize(("model", "inputs", "field", "words"), [
    ("ensemble", {"image_url_input": _url(b"plain text, not an image")}, "image_url_input", "not a readable image"),
    ("ensemble", {"image_url_input": np.array([[b"http://127.0.0.1/cat.png"]], dtype=np.object_)},
     "image_url_input", "fetches no URLs"),
    ("ensemble", {"image_bytes_input": np.zeros((1, 1, 5, 6, 7), np.uint8)}, "image_bytes_input", "channel axis"),
    ("ensemble", {"image_bytes_input": np.zeros((1, 2, 30, 40, 3), np.uint8)}, "image_bytes_input", "placeholders"),
])
def test_a_bad_image_is_refused_naming_the_input_and_the_server_goes_on(llava_server, model, inputs, field, words):
    result = llava_server.grpc_stream(model, _row(**inputs))
    assert result.error is not None
    assert words in str(result.error) and f"field={field}" in str(result.error)
    assert _text(llava_server, "ensemble", _row(image_url_input=_url(_png(0))))
    llava_server.wait_idle()


def test_the_preprocessing_step_refuses_images_naming_the_input(llava_server):
    values = {"text_input": np.array([PROMPT.encode()], dtype=np.object_), "image_url_input": _url(_png(0))[0]}
    result = llava_server.grpc_stream("preprocessing", values)
    assert result.error is not None and "field=image_url_input" in str(result.error)


def test_the_encoder_cache_counters_reach_the_metrics_port(llava_server):
    before = (llava_server.metric("vllm:mm_cache_queries"), llava_server.metric("vllm:mm_cache_hits"))
    png = base64.b64encode(_png(5)).decode()
    for prompt in ("First <image> seen.", "Again <image> seen."):  # other text first: no prefix hit skips it
        assert _text(llava_server, "llm", {"text_input": prompt, "image": [png],
                                            "sampling_parameters": {"max_tokens": 2}})
    llava_server.wait_idle()
    after = (llava_server.metric("vllm:mm_cache_queries"), llava_server.metric("vllm:mm_cache_hits"))
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)
