"""The llm model's `image` input: base64 image files (a data URL's payload too), each refused by name when it is
not base64, too large, or when there are none or too many."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton import image_inputs
from pagedserve.backend.triton.image_inputs import MAX_IMAGES, image_input


class _Tensor:
    def __init__(self, values: list[object]):
        self._array = np.array(values, dtype=np.object_)

    def as_numpy(self) -> np.ndarray:
        return self._array


def test_absent_image_input_is_none():
    assert image_input({}) is None


def test_base64_files_and_data_urls_decode_to_their_bytes():
    files = [b"\x89PNG first", b"GIF89a second"]
    values = [base64.b64encode(files[0]), "data:image/gif;base64," + base64.b64encode(files[1]).decode()]
    assert image_input({"image": _Tensor(values)}) == files


@pytest.mark.parametrize(("values", "words"), [
    ([], "at least one"),
    (["***"], "image\\[0\\] is not base64"),
    ([base64.b64encode(b"x"), "data:image/png,raw"], "image\\[1\\] is a data URL without ;base64"),
    ([base64.b64encode(b"x")] * (MAX_IMAGES + 1), "at most"),
])
def test_bad_image_input_is_refused_naming_image(values, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        image_input({"image": _Tensor(values)})
    assert info.value.field == "image"


def test_an_image_over_the_size_limit_is_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(image_inputs, "MAX_IMAGE_BYTES", 30)
    with pytest.raises(InvalidRequestError, match="over 30 bytes"):
        image_input({"image": _Tensor([base64.b64encode(b"y" * 60)])})
    assert image_input({"image": _Tensor([base64.b64encode(b"y" * 30)])}) == [b"y" * 30]
