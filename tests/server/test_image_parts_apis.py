"""Images in the Responses API (input_image parts) and Anthropic's Messages (image blocks) read into the chat
path's image_url parts in order; each bad part refused naming its field in that API's words; the llm model's
refusal of an image named by that image's field."""

from __future__ import annotations

import asyncio
import base64

import pytest

from pagedserve.backend.core.errors import InvalidRequestError, to_wire
from pagedserve.client.openai.anthropic_protocol import anthropic_error, chat_body
from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.image_parts import (
    anthropic_image_fields,
    chat_error,
    llm_error,
    responses_image_fields,
)
from pagedserve.client.openai.media import MediaSettings, resolve_images
from pagedserve.client.openai.protocol import parse_chat_request
from pagedserve.client.openai.responses_input import read_responses_request
from pagedserve.client.triton_client import TritonRequestError

PNG = base64.b64encode(b"\x89PNG fake").decode()
DATA_URL = f"data:image/png;base64,{PNG}"


def _responses(*parts: dict, role: str = "user") -> dict:
    return {"model": "m", "input": [{"role": role, "content": [{"type": "input_text", "text": "a "}, *parts]}]}


def _messages(*blocks: dict) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a "}, *blocks]}]}


def _image_block(**source) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG, **source}}


def test_input_image_parts_become_chat_image_parts_in_order():
    read = read_responses_request(_responses({"type": "input_image", "image_url": DATA_URL, "detail": "low"},
                                             {"type": "input_text", "text": " b"}), [])
    content = read.chat_body["messages"][0]["content"]
    assert content == [{"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": DATA_URL}},
                       {"type": "text", "text": " b"}]
    chat = parse_chat_request(read.chat_body)
    assert chat.images == [PNG] and chat.messages[0]["content"].startswith("a ")
    only_text = read_responses_request(_responses({"type": "input_text", "text": "b"}), [])
    assert only_text.chat_body["messages"][0]["content"] == "a b"  # text parts alone stay one string


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_image", "image_url": "ftp://127.0.0.1/cat.png"}, "input[0].content[1].image_url"),
    ({"type": "input_image", "image_url": "data:image/png;base64,***"}, "input[0].content[1].image_url"),
    ({"type": "input_image", "image_url": f"data:text/plain;base64,{PNG}"}, "input[0].content[1].image_url"),
    ({"type": "input_image"}, "input[0].content[1].image_url"),
    ({"type": "input_image", "image_url": DATA_URL, "detail": "huge"}, "input[0].content[1].detail"),
    ({"type": "input_image", "file_id": "file-1"}, "input[0].content[1].file_id"),
    ({"type": "input_audio", "input_audio": {}}, "input[0].content[1]"),
])
def test_bad_input_image_parts_are_refused_naming_the_field(part, param):
    with pytest.raises(APIError) as info:
        read_responses_request(_responses(part), [])
    assert info.value.status == 400 and info.value.param == param


def test_image_blocks_become_chat_image_parts_in_order():
    chat = chat_body(_messages(_image_block(media_type="image/webp"), {"type": "text", "text": " b"}))
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "a "}, {"type": "image_url", "image_url": {"url": f"data:image/webp;base64,{PNG}"}},
        {"type": "text", "text": " b"}]
    assert parse_chat_request(chat).images == [PNG]


@pytest.mark.parametrize(("block", "param"), [
    ({"type": "image", "source": {"type": "url", "url": "ftp://example.com/cat.png"}}, "source.url"),
    ({"type": "image", "source": {"type": "url"}}, "source.url"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "source.type"),
    ({"type": "image"}, "source"),
    (_image_block(media_type="image/tiff"), "source.media_type"),
    (_image_block(data="***"), "source.data"),
    (_image_block(data=""), "source.data"),
])
def test_bad_image_blocks_are_refused_in_anthropics_shape_naming_the_field(block, param):
    with pytest.raises(APIError) as info:
        chat_body(_messages(block))
    assert info.value.param == f"messages.0.content.1.{param}"
    error = anthropic_error(info.value)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"messages.0.content.1.{param}")


def test_an_image_block_in_an_assistant_message_is_refused():
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": [_image_block()]}]}
    with pytest.raises(APIError) as info:
        chat_body(body)
    assert info.value.param == "messages.0.content.0.type"


def test_image_fields_in_the_order_the_engine_gets_the_images():
    part = {"type": "input_image", "image_url": DATA_URL}
    body = {"input": [{"role": "user", "content": [part]}, {"role": "user", "content": [
        {"type": "input_text", "text": "x"}, part]}]}
    previous = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]},
                {"role": "assistant", "content": "ok"}]
    assert responses_image_fields(body, previous) == [
        "previous_response_id", "input[0].content[0].image_url", "input[1].content[1].image_url"]
    messages = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": [{"type": "text", "text": "x"}, _image_block()]}]}
    assert anthropic_image_fields(messages) == ["messages.2.content.1.source.data"]


def test_an_llm_refusal_of_an_image_names_that_images_field():
    fields = ["input[0].content[0].image_url", "input[0].content[2].image_url"]
    unreadable = TritonRequestError(to_wire(InvalidRequestError("images[1] is not a readable image file: x",
                                                                "images")))
    named = llm_error(unreadable, {}, fields, "input")
    assert (named.status, named.param) == (400, fields[1]) and "not a readable image" in named.message
    count = TritonRequestError(to_wire(InvalidRequestError("the prompt holds 1 image placeholders", "images")))
    assert llm_error(count, {}, fields, "input").param == "input"
    other = TritonRequestError(to_wire(InvalidRequestError("max_tokens must be positive", "max_tokens")))
    assert llm_error(other, {}, fields, "input").param == "max_tokens"


def test_http_urls_go_to_the_fetch_and_its_refusal_names_the_part():
    url = "http://127.0.0.1:9/cat.png"
    read = read_responses_request(_responses({"type": "input_image", "image_url": url}), [])
    body = _messages({"type": "image", "source": {"type": "url", "url": url}})
    for chat, fields, field in [
        (read.chat_body, responses_image_fields(_responses({"type": "input_image", "image_url": url}), []),
         "input[0].content[1].image_url"),
        (chat_body(body), anthropic_image_fields(body), "messages.0.content.1.source.url")]:
        request = parse_chat_request(chat)
        assert request.images == [url]
        with pytest.raises(APIError) as info:  # no --allowed-media-domains: nothing is fetched
            asyncio.run(resolve_images(request.images, request.image_params, MediaSettings()))
        named = chat_error(info.value, chat["messages"], fields, field.rsplit(".", 1)[-1])
        assert named.param == field and "fetches no http" in named.message
    other = APIError(400, "max_tokens must be positive", "max_tokens")
    assert chat_error(other, read.chat_body["messages"], ["x"], "image_url") is other
