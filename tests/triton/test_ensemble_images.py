"""The ensemble's TensorRT-LLM multimodal inputs: `image_bytes_input` pixels (CHW or HWC) become PNG files holding
exactly those pixels, `image_url_input` data URLs pass on as they are; http(s) URLs, bad shapes, both inputs at
once and too many images are refused naming the input."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton.ensemble_images import (
    IMAGE_BYTES,
    IMAGE_URL,
    image_error_field,
    png_file,
    row_images,
)
from pagedserve.backend.triton.image_inputs import MAX_IMAGES


def _pixels(height: int, width: int, channels: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def _decoded(file: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(file))))


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_hwc_and_chw_pixels_become_png_files_with_those_pixels(channels):
    hwc = _pixels(7, 5, channels, seed=channels)
    chw = np.moveaxis(hwc, -1, 0)
    images = row_images(np.stack([hwc]), [])
    assert images.field == IMAGE_BYTES
    for array in (hwc, chw):
        (file,) = row_images(array[None], []).files
        expected = hwc[..., 0] if channels == 1 else hwc
        assert np.array_equal(_decoded(file), expected)
    assert images.files == row_images(chw[None], []).files


def test_several_images_of_a_row_keep_their_order():
    first, second = _pixels(6, 6, 3, seed=1), _pixels(6, 6, 3, seed=2)
    files = row_images(np.stack([first, second]), []).files
    assert np.array_equal(_decoded(files[0]), first) and np.array_equal(_decoded(files[1]), second)


def test_data_urls_pass_on_and_no_input_is_none():
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()
    images = row_images(None, [url])
    assert images.field == IMAGE_URL and images.files == [url]
    assert row_images(None, []) is None


@pytest.mark.parametrize(("pixels", "urls", "field", "words"), [
    (np.zeros((1, 4, 4, 3), np.uint8), ["data:image/png;base64,AA=="], IMAGE_URL, "not both"),
    (np.zeros((4, 4, 3), np.uint8), [], IMAGE_BYTES, "num_images"),
    (np.zeros((0, 4, 4, 3), np.uint8), [], IMAGE_BYTES, "no image"),
    (np.zeros((MAX_IMAGES + 1, 2, 2, 3), np.uint8), [], IMAGE_BYTES, f"at most {MAX_IMAGES}"),
    (np.zeros((1, 5, 6, 7), np.uint8), [], IMAGE_BYTES, "no channel axis"),
    (np.zeros((1, 0, 6, 3), np.uint8), [], IMAGE_BYTES, "empty"),
    (None, ["https://example.com/cat.png"], IMAGE_URL, "fetches no URLs"),
    (None, ["http://127.0.0.1/cat.png"], IMAGE_URL, "fetches no URLs"),
    (None, ["data:image/png,rawbytes"], IMAGE_URL, ";base64"),
    (None, ["file:///etc/passwd"], IMAGE_URL, ";base64"),
])
def test_bad_image_inputs_are_refused_naming_the_input(pixels, urls, field, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        row_images(pixels, urls)
    assert info.value.field == field


def test_pixels_over_pillows_limit_are_refused_before_encoding(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20)
    with pytest.raises(InvalidRequestError, match="over Pillow's limit") as info:
        png_file(np.zeros((5, 5, 3), np.uint8), 0)
    assert info.value.field == IMAGE_BYTES
    assert png_file(np.zeros((4, 5, 3), np.uint8), 0).startswith(b"\x89PNG")


def test_llm_refusals_of_the_images_name_the_rows_image_input():
    assert image_error_field("images", IMAGE_URL) == IMAGE_URL
    assert image_error_field("image", IMAGE_BYTES) == IMAGE_BYTES
    assert image_error_field("prompt", IMAGE_BYTES) == "prompt"
    assert image_error_field("images", None) == "images"
