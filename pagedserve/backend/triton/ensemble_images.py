"""The ensemble's images under TensorRT-LLM's multimodal input names, made into the llm model's `image` input.

`image_bytes_input` (UINT8, per row `[num_images, C, H, W]` or `[num_images, H, W, C]`): decoded pixels, as
TensorRT-LLM's ensemble takes them; each image goes to the llm as a PNG file (lossless: the processor sees these
pixels). Channels first when the first axis is 1, 3 or 4, else last (transformers' own rule, first axis first).
`image_url_input` (STRING, per row one URL or several, ragged rows padded with empty strings): `data:` URLs with
base64 payloads, passed on as they are. http(s) URLs are refused: the fetch with its host allow-list, size and time
limits belongs to the OpenAI shim (`--allowed-media-domains`), whose async client a Triton model cannot import.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton.image_inputs import MAX_IMAGES

IMAGE_BYTES = "image_bytes_input"
IMAGE_URL = "image_url_input"
_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


@dataclass(frozen=True)
class RowImages:
    """One row's images for the llm's `image` input, and the ensemble input they came from (errors name it)."""

    field: str
    files: list[str]


def row_images(pixels: np.ndarray | None, urls: list[str]) -> RowImages | None:
    """A row's images from its `image_bytes_input` pixels or its `image_url_input` URLs; None without any.
    Refused naming the input: both given, too many images, a bad shape, a URL that is not a base64 data URL."""
    if pixels is not None and urls:
        raise InvalidRequestError(f"give {IMAGE_BYTES} or {IMAGE_URL}, not both", IMAGE_URL)
    if pixels is not None:
        if pixels.ndim != 4:
            raise InvalidRequestError(f"{IMAGE_BYTES} must be [batch, num_images, C, H, W] or [batch, num_images, "
                                      f"H, W, C] uint8 pixels, got a row of shape {list(pixels.shape)}", IMAGE_BYTES)
        _check_count(len(pixels), IMAGE_BYTES)
        return RowImages(IMAGE_BYTES, [base64.b64encode(png_file(image, index)).decode("ascii")
                                       for index, image in enumerate(pixels)])
    if not urls:
        return None
    _check_count(len(urls), IMAGE_URL)
    for index, url in enumerate(urls):
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in ("http", "https"):
            raise InvalidRequestError(f"{IMAGE_URL}[{index}] is an {scheme} URL: the ensemble fetches no URLs (send a "
                                      f"data: URL or {IMAGE_BYTES}; the OpenAI shim fetches allowed hosts)", IMAGE_URL)
        if scheme != "data" or "," not in url or not url.split(",", 1)[0].endswith(";base64"):
            raise InvalidRequestError(f"{IMAGE_URL}[{index}] must be a data:image/...;base64, URL", IMAGE_URL)
    return RowImages(IMAGE_URL, list(urls))


def _check_count(count: int, field: str) -> None:
    if count == 0:
        raise InvalidRequestError(f"{field} holds no image", field)
    if count > MAX_IMAGES:
        raise InvalidRequestError(f"{field} holds {count} images; at most {MAX_IMAGES} a request", field)


def png_file(pixels: np.ndarray, index: int) -> bytes:
    """One image's uint8 pixels (CHW or HWC) as a PNG file; refused naming image_bytes_input[index] when the
    shape is not an image's or it is over Pillow's pixel limit."""
    from PIL import Image

    if pixels.shape[0] in _CHANNELS:
        pixels = np.moveaxis(pixels, 0, -1)
    elif pixels.shape[-1] not in _CHANNELS:
        raise InvalidRequestError(f"{IMAGE_BYTES}[{index}] of shape {list(pixels.shape)} has no channel axis of "
                                  f"1, 3 or 4 first or last", IMAGE_BYTES)
    height, width, channels = pixels.shape
    if not height or not width:
        raise InvalidRequestError(f"{IMAGE_BYTES}[{index}] is empty ({height} x {width})", IMAGE_BYTES)
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > limit:
        raise InvalidRequestError(f"{IMAGE_BYTES}[{index}] has {height * width} pixels, over Pillow's limit of "
                                  f"{limit}", IMAGE_BYTES)
    picture = Image.fromarray(np.ascontiguousarray(pixels[..., 0] if channels == 1 else pixels))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", compress_level=1)  # lossless; low effort: the llm decodes it at once
    return buffer.getvalue()


def image_error_field(field: str | None, image_field: str | None) -> str | None:
    """The ensemble input an llm refusal of a row's images names: the llm's `image` / `images` become the row's
    image input; any other field is kept."""
    if image_field is not None and field in ("image", "images"):
        return image_field
    return field
