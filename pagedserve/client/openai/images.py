"""Chat content parts that carry images: `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`.
Each part stands in the message's text as a marker until the chat template has rendered the messages; the markers
then become the model's own image placeholder (its processor's `image_token`), and the images go to the `llm`
model's `image` input in prompt order. http(s) URLs are kept as they are here and fetched once the request is
parsed (media.py), from hosts --allowed-media-domains lists only."""

from __future__ import annotations

import base64
import binascii
import functools
import json
from pathlib import Path
from typing import Any

from pagedserve.client.openai.errors import bad_request
from pagedserve.client.openai.media import is_http_url

IMAGE_MARKER = "\x00pagedserve-image\x00"  # a text holding it makes a placeholder count the engine refuses


def image_part_text(part: dict, where: str) -> str:
    """The marker an image_url part leaves in its message's text, once its URL is checked."""
    url = _url(part, where)
    if is_http_url(url):
        return IMAGE_MARKER  # fetched (or refused naming this url) by media.resolve_images
    header, _, payload = url.partition(",")
    if not (header.startswith("data:image/") and header.endswith(";base64")) or not payload:
        raise bad_request("image_url.url must be a data:image/...;base64, or an http(s) URL",
                          f"{where}.image_url.url")
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("image_url.url's data is not base64", f"{where}.image_url.url") from None
    return IMAGE_MARKER


def message_images(messages: list[Any]) -> tuple[list[str], list[str]]:
    """The image of every image_url part of the (checked) messages, in order: a data URL's base64 payload or an
    http(s) URL as it is; and each part's url field name (for refusals of the fetch)."""
    images, params = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = _url(part, "")
                images.append(url if is_http_url(url) else url.partition(",")[2])
                params.append(f"messages[{i}].content[{j}].image_url.url")
    return images, params


def with_placeholders(prompt: str, model_dir: str | Path) -> str:
    """The rendered prompt with each image marker replaced by the model's image placeholder; a model without
    one (no processor) takes no images."""
    if IMAGE_MARKER not in prompt:
        return prompt
    placeholder = image_placeholder(str(model_dir))
    if placeholder is None:
        raise bad_request("this model takes no images (its folder has no processor with an image token)",
                          "messages")
    return prompt.replace(IMAGE_MARKER, placeholder)


# What the chat templates of families whose processor configs name no image token render for an image part.
_TEMPLATE_PLACEHOLDERS = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "idefics3": "<image>",
}


# Families whose processor takes another token than the tokenizer's image_token as an image's placeholder (Gemma 3's
# processor expands its begin-of-image token; the tokenizer's image_token is the soft token it expands into).
_PROCESSOR_PLACEHOLDERS = {"gemma3": "<start_of_image>"}


@functools.cache
def image_placeholder(model_dir: str) -> str | None:
    """The model processor's image token (processor_config.json, else tokenizer_config.json), else what its
    family's chat template renders for an image (by config.json's model_type); None without."""
    config = Path(model_dir) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type in _PROCESSOR_PLACEHOLDERS:
        return _PROCESSOR_PLACEHOLDERS[model_type]
    for name in ("processor_config.json", "tokenizer_config.json"):
        config = Path(model_dir) / name
        if config.is_file():
            token = json.loads(config.read_text()).get("image_token")
            if isinstance(token, str) and token:
                return token
    return _TEMPLATE_PLACEHOLDERS.get(model_type)


def _url(part: dict, where: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise bad_request("an image_url part needs image_url.url, a string", where)
    return url
