"""Images in the Responses API (`input_image` parts) and Anthropic's Messages (`image` blocks), read into the chat
path's `image_url` parts (images.py renders them and sends the llm model its `image` input), and the llm model's
refusal of an image named as the request names that image. http(s) URLs (an input_image's image_url, a `url`
source) go on as the chat's image_url parts do: fetched by media.py from the hosts --allowed-media-domains lists,
its refusals renamed here to the part's field."""

from __future__ import annotations

import base64
import binascii
import re

from pagedserve.backend.core.errors import ErrorKind, from_wire
from pagedserve.client.openai.errors import APIError, bad_request, triton_api_error
from pagedserve.client.openai.images import message_images
from pagedserve.client.openai.media import is_http_url

DETAILS = ("auto", "low", "high")  # taken and not acted on: the model's processor decides the resolution
ANTHROPIC_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's accepted types
_ENGINE_IMAGE_FIELDS = ("images", "image")  # the engine's and the llm model's image fields
_INDEXED = re.compile(r"\bimages?\[(\d+)\]")


def input_image_part(part: dict, at: str) -> dict:
    """The chat image_url part of a Responses `input_image` part at `at` (input[i].content[j])."""
    if part.get("file_id") is not None:
        raise bad_request(f"'{at}.file_id' is not supported by pagedserve (no Files API): send image_url as a "
                          "data:image/...;base64, URL", f"{at}.file_id")
    url, detail = part.get("image_url"), part.get("detail", "auto")
    if detail is not None and detail not in DETAILS:
        raise bad_request(f"'{at}.detail' must be one of {list(DETAILS)}", f"{at}.detail")
    if not isinstance(url, str):
        raise bad_request(f"'{at}.image_url' must be a URL string", f"{at}.image_url")
    if is_http_url(url):
        return {"type": "image_url", "image_url": {"url": url}}  # fetched (or refused) by media.resolve_images
    header, _, payload = url.partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64")) or not payload:
        raise bad_request(f"'{at}.image_url' must be a data:image/...;base64, or an http(s) URL", f"{at}.image_url")
    _check_base64(payload, f"{at}.image_url", f"'{at}.image_url' holds data that")
    return {"type": "image_url", "image_url": {"url": url}}


def anthropic_image_part(block: dict, at: str) -> dict:
    """The chat image_url part of an Anthropic image block at `at` (messages.i.content.j)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{at}.source: an image block needs a source object", f"{at}.source")
    kind = source.get("type")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not is_http_url(url):
            raise bad_request(f"{at}.source.url: must be an http(s) URL", f"{at}.source.url")
        return {"type": "image_url", "image_url": {"url": url}}  # fetched (or refused) by media.resolve_images
    if kind != "base64":
        raise bad_request(f"{at}.source.type: {kind!r} is not a source type pagedserve takes (base64, url)",
                          f"{at}.source.type")
    media_type, data = source.get("media_type"), source.get("data")
    if media_type not in ANTHROPIC_MEDIA_TYPES:
        raise bad_request(f"{at}.source.media_type: must be one of {list(ANTHROPIC_MEDIA_TYPES)}",
                          f"{at}.source.media_type")
    if not isinstance(data, str) or not data:
        raise bad_request(f"{at}.source.data: must be a non-empty base64 string", f"{at}.source.data")
    _check_base64(data, f"{at}.source.data", f"{at}.source.data:")
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def responses_image_fields(body: dict, previous: list[dict]) -> list[str]:
    """The field of each image a Responses request sends the engine, in order: a previous response's images
    first (named previous_response_id), then each input_image part's image_url."""
    fields = ["previous_response_id"] * sum(_chat_images(message) for message in previous)
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "input_image":
                fields.append(f"input[{i}].content[{j}].image_url")
    return fields


def anthropic_image_fields(body: dict) -> list[str]:
    """The field of each image block's data (or url) in a Messages request, in the order the engine gets them."""
    fields = []
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") == "image":
                source = block.get("source")
                url = isinstance(source, dict) and source.get("type") == "url"
                fields.append(f"messages.{i}.content.{j}.source.{'url' if url else 'data'}")
    return fields


def chat_error(error: APIError, chat_messages: list[dict], fields: list[str], words: str) -> APIError:
    """A chat refusal of an image_url part (media.py's fetch) named by that image's field in this API, `words`
    the API's name for the URL in the message."""
    _, params = message_images(chat_messages)
    if error.param not in params:
        return error
    return APIError(error.status, error.message.replace("image_url.url", words),
                    fields[params.index(error.param)], error.code)


def llm_error(error: Exception, renames: dict[str, str], fields: list[str], whole: str) -> APIError:
    """The llm model's error as the API's: a refusal of an image (`images[k] is not a readable image`) names
    that image's field, one of all the images names `whole`; others as triton_api_error makes them."""
    wire = from_wire(str(error))
    if wire is None or wire.kind is not ErrorKind.INVALID_ARGUMENT or wire.field not in _ENGINE_IMAGE_FIELDS:
        return triton_api_error(error, renames)
    match = _INDEXED.search(wire.message)
    index = int(match.group(1)) if match else None
    param = fields[index] if index is not None and index < len(fields) else whole
    return bad_request(wire.message, param)


def _chat_images(message: dict) -> int:
    content = message.get("content")
    return sum(isinstance(part, dict) and part.get("type") == "image_url"
               for part in (content if isinstance(content, list) else []))


def _check_base64(payload: str, param: str, words: str) -> None:
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{words} is not base64", param) from None
