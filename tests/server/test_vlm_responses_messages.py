"""A tiny LLaVA through tritonserver and the shim: the Responses API's input_image parts (official `openai`
client) and Anthropic image blocks (official `anthropic` client) answer, whole and streamed, the greedy text
chat completions gives for the same image and prompt, inline or fetched from an allowed loopback URL; bad images
are refused in each API's own shape naming the field, and the server serves on."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anthropic
import openai
import pytest

from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
HEAD, TAIL = "Describe ", " in one line please."
NOT_AN_IMAGE = base64.b64encode(b"plain text, not an image").decode()


def _png(seed: int) -> str:
    buffer = io.BytesIO()
    tiny_image(40, 30, seed=seed).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-apis"), "clip", seed=3)


@pytest.fixture(scope="module")
def llava_server(llava_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64"}
    with triton_running(llava_path, tmp_path_factory.mktemp("llava-apis"), params, llm_only=True) as running:
        yield running


@pytest.fixture(scope="module")
def images_url(tmp_path_factory) -> Iterator[str]:
    """A loopback http server of image 3 as cat.png."""
    folder = tmp_path_factory.mktemp("images")
    (folder / "cat.png").write_bytes(base64.b64decode(_png(3)))
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def shim_url(llava_server) -> Iterator[str]:
    with llava_server.openai_shim("--allowed-media-domains", "127.0.0.1") as url:
        yield url


@pytest.fixture(scope="module")
def oai(shim_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(shim_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=shim_url, api_key="none", max_retries=0)


def _model(oai) -> str:
    return oai.models.list().data[0].id


def _chat_text(oai, image: str) -> str:
    content = [{"type": "text", "text": HEAD}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
               {"type": "text", "text": TAIL}]
    reply = oai.chat.completions.create(model=_model(oai), max_tokens=MAX_TOKENS, temperature=0.0,
                                        messages=[{"role": "user", "content": content}],
                                        extra_body={"ignore_eos": True})
    return reply.choices[0].message.content


def _responses_input(image_url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": HEAD},
                                         {"type": "input_image", "image_url": image_url, "detail": "auto"},
                                         {"type": "input_text", "text": TAIL}]}]


def _messages(image_block: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": HEAD}, image_block,
                                         {"type": "text", "text": TAIL}]}]


def _image_block(data: str, **source) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data, **source}}


def _claude(claude, oai, image_block: dict, **fields):
    return claude.messages.create(model=_model(oai), max_tokens=MAX_TOKENS, messages=_messages(image_block),
                                  extra_body={"temperature": 0, "ignore_eos": True}, **fields)


def test_responses_input_image_answers_the_chat_text(oai, llava_server):
    texts = []
    for seed in (0, 1):
        image = _png(seed)
        chat = _chat_text(oai, image)
        fields = {"model": _model(oai), "input": _responses_input(f"data:image/png;base64,{image}"),
                  "max_output_tokens": MAX_TOKENS, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
        whole = oai.responses.create(**fields)
        assert whole.status in ("completed", "incomplete")
        assert whole.output_text == chat and whole.usage.input_tokens > 16  # the image's 16 tokens counted
        with oai.responses.stream(**fields) as stream:
            streamed = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        assert streamed == chat
        texts.append(chat)
    assert texts[0] != texts[1]  # the image, not only the text, decides the answer
    llava_server.wait_idle()


def test_messages_image_block_answers_the_chat_text(oai, claude, llava_server):
    image = _png(2)
    chat = _chat_text(oai, image)
    whole = _claude(claude, oai, _image_block(image))
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text == chat
    assert whole.usage.input_tokens > 16
    with claude.messages.stream(model=_model(oai), max_tokens=MAX_TOKENS, messages=_messages(_image_block(image)),
                                extra_body={"temperature": 0, "ignore_eos": True}) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == chat
    llava_server.wait_idle()


@pytest.mark.parametrize(("image_url", "param"), [
    (f"data:image/png;base64,{NOT_AN_IMAGE}", "input[0].content[1].image_url"),  # the llm model's refusal
    ("data:image/png;base64,***", "input[0].content[1].image_url"),
    ("http://10.0.0.1/cat.png", "input[0].content[1].image_url"),  # a host not allowed
])
def test_responses_bad_images_are_refused_naming_the_field(oai, llava_server, image_url, param):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=_model(oai), input=_responses_input(image_url), max_output_tokens=4)
    assert refused.value.body["param"] == param and refused.value.body["type"] == "invalid_request_error"
    ok = oai.responses.create(model=_model(oai), input=_responses_input(f"data:image/png;base64,{_png(0)}"),
                              max_output_tokens=2)
    assert ok.status in ("completed", "incomplete")
    llava_server.wait_idle()


@pytest.mark.parametrize(("block", "param", "words"), [
    (_image_block(NOT_AN_IMAGE), "messages.0.content.1.source.data", "not a readable image"),
    ({"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/cat.png"}},
     "messages.0.content.1.source.url", "not in --allowed-media-domains"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "messages.0.content.1.source.type",
     "not a source type"),
    (_image_block(NOT_AN_IMAGE, media_type="image/tiff"), "messages.0.content.1.source.media_type", "one of"),
])
def test_messages_bad_images_are_refused_in_anthropics_shape(oai, claude, llava_server, block, param, words):
    with pytest.raises(anthropic.BadRequestError) as refused:
        _claude(claude, oai, block)
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param) and words in error["error"]["message"]
    ok = _claude(claude, oai, _image_block(_png(0)))
    assert ok.content[0].text
    llava_server.wait_idle()


def test_an_allowed_loopback_url_answers_as_the_same_image_inline(oai, claude, llava_server, images_url):
    chat = _chat_text(oai, _png(3))
    fetched = oai.responses.create(model=_model(oai), input=_responses_input(f"{images_url}/cat.png"),
                                   max_output_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    assert fetched.output_text == chat
    block = {"type": "image", "source": {"type": "url", "url": f"{images_url}/cat.png"}}
    assert _claude(claude, oai, block).content[0].text == chat
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=_model(oai), input=_responses_input(f"{images_url}/missing.png"),
                             max_output_tokens=2)
    assert refused.value.body["param"] == "input[0].content[1].image_url" and "404" in refused.value.body["message"]
    llava_server.wait_idle()
