"""The shim's image_url content parts: data URLs become the model's placeholders (after the chat template) and
the llm model's image input, in order; other URLs and bad data are refused naming the part's url."""

from __future__ import annotations

import base64
import json

import pytest

from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.images import IMAGE_MARKER, image_placeholder, with_placeholders
from pagedserve.client.openai.protocol import parse_chat_request

PNG = base64.b64encode(b"\x89PNG fake").decode()


def _chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_url_parts_become_markers_and_images_in_order():
    other = base64.b64encode(b"GIF89a fake").decode()
    request = parse_chat_request(_chat({"type": "text", "text": "a "}, _image(f"data:image/png;base64,{PNG}"),
                                       {"type": "text", "text": " b "}, _image(f"data:image/gif;base64,{other}")))
    assert request.messages[0]["content"] == f"a {IMAGE_MARKER} b {IMAGE_MARKER}"
    assert request.images == [PNG, other]


@pytest.mark.parametrize("url", ["ftp://example.com/cat.png", "data:image/png,rawbytes", "data:text/plain;base64,"
                                 + PNG, "data:image/png;base64,***"])
def test_other_urls_and_bad_data_are_refused_naming_the_url(url):
    with pytest.raises(APIError) as info:
        parse_chat_request(_chat(_image(url)))
    assert info.value.param == "messages[0].content[0].image_url.url"


def test_markers_become_the_models_image_token(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_token": "<image>"}))
    assert with_placeholders(f"x {IMAGE_MARKER} y", tmp_path) == "x <image> y"
    assert with_placeholders("no images", tmp_path / "missing") == "no images"


@pytest.mark.parametrize(("model_type", "placeholder"), [
    ("qwen2_5_vl", "<|vision_start|><|image_pad|><|vision_end|>"), ("qwen2_vl", "<|vision_start|><|image_pad|><|vision_end|>"),
    ("idefics3", "<image>"), ("llama", None)])
def test_families_without_a_processor_image_token_take_their_templates_placeholder(tmp_path, model_type,
                                                                                   placeholder):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "SomeProcessor"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert image_placeholder(str(tmp_path)) == placeholder


def test_a_model_without_an_image_token_refuses_images(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert image_placeholder(str(tmp_path)) is None
    with pytest.raises(APIError, match="takes no images") as info:
        with_placeholders(IMAGE_MARKER, tmp_path)
    assert info.value.param == "messages"


def test_http_urls_are_kept_for_the_fetch_and_refused_by_default_naming_the_url():
    import asyncio

    from pagedserve.client.openai.media import MediaSettings, resolve_images

    request = parse_chat_request(_chat(_image(f"data:image/png;base64,{PNG}"), _image("http://example.com/cat.png")))
    assert request.images == [PNG, "http://example.com/cat.png"]
    assert request.image_params == ["messages[0].content[0].image_url.url", "messages[0].content[1].image_url.url"]
    with pytest.raises(APIError, match="fetches no http") as info:
        asyncio.run(resolve_images(request.images, request.image_params, MediaSettings()))
    assert info.value.param == "messages[0].content[1].image_url.url"
