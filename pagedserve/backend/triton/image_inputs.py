"""The `llm` model's `image` input, as Triton's vLLM backend names it: BYTES [-1], each element one base64-encoded
image file (a `data:image/...;base64,` prefix allowed), beside a `text_input` holding the model's placeholders."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError

IMAGE = "image"
MAX_IMAGES = 16  # images one request may carry
MAX_IMAGE_BYTES = 20 << 20  # one decoded image file


def image_input(inputs: dict[str, Any]) -> list[bytes] | None:
    """The decoded image files of the optional `image` input; None when absent. Refused naming `image`: none,
    too many, not base64, or a file over MAX_IMAGE_BYTES."""
    tensor = inputs.get(IMAGE)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if not len(values):
        raise InvalidRequestError("image must hold at least one base64-encoded image file", IMAGE)
    if len(values) > MAX_IMAGES:
        raise InvalidRequestError(f"image holds {len(values)} images; at most {MAX_IMAGES} a request", IMAGE)
    return [_decode(value, index) for index, value in enumerate(values)]


def _decode(value: object, index: int) -> bytes:
    raw = value.encode("ascii", "replace") if isinstance(value, str) else bytes(value)
    if raw.startswith(b"data:"):
        header, _, raw = raw.partition(b",")
        if not header.endswith(b";base64"):
            raise InvalidRequestError(f"image[{index}] is a data URL without ;base64", IMAGE)
    if len(raw) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4:
        raise InvalidRequestError(f"image[{index}] is over {MAX_IMAGE_BYTES} bytes", IMAGE)
    try:
        return base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError) as error:
        raise InvalidRequestError(f"image[{index}] is not base64: {error}", IMAGE) from None
