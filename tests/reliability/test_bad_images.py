"""The bad-image catalogue through real servers: a tiny LLaVA behind tritonserver (one for the module) and its
OpenAI shim (one, with --allowed-media-domains localhost and --limit-mm-per-prompt '{"image": 2}'), and the
text-only session server of the reliability tests. Each bad request is refused naming its field (the llm model's
wire tag, the shim's `param`); afterwards a good request with an image succeeds and no KV block is held
(wait_idle). Fetch limits (size, timeout, redirects) are tested against a loopback server in
tests/server/test_openai_media.py."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator

import httpx
import pytest

from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

PROMPT = "Describe <image> briefly."
GREEDY = {"temperature": 0.0, "max_tokens": 4}


def _png(seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    tiny_image(40, 30, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def _bomb(side: int = 20000) -> bytes:
    """A small PNG whose header claims side x side pixels, over twice Pillow's MAX_IMAGE_PIXELS (its error)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit grey
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


GOOD = _b64(_png())

# name: (text_input, image elements, the field the llm model names)
LLM_CASES = {
    "bytes that are not an image": (PROMPT, [_b64(b"plain text, not an image")], "images"),
    "a truncated file": (PROMPT, [_b64(_png()[:60])], "images"),
    "a decompression bomb": (PROMPT, [_b64(_bomb())], "images"),
    "more images than placeholders": (PROMPT, [GOOD, GOOD], "images"),
    "fewer images than placeholders": (PROMPT + " And <image>.", [GOOD], "images"),
    "more images than the llm model takes": (PROMPT * 17, [GOOD] * 17, "image"),
    "not base64": (PROMPT, ["%%% not base64"], "image"),
}


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    path = make_tiny_llava(tmp_path_factory.mktemp("bad-images-llava"), "clip", seed=5)
    params = {**CPU_FP32, "max_model_len": "1024", "num_blocks": "96"}
    with triton_running(path, tmp_path_factory.mktemp("bad-images-server"), params, llm_only=True) as running:
        yield running


@pytest.fixture(scope="module")
def vlm_shim(vlm_server: RunningTriton) -> Iterator[str]:
    with vlm_server.openai_shim("--model-name", "vlm", "--allowed-media-domains", "localhost",
                                "--limit-mm-per-prompt", '{"image": 2}') as url:
        yield url


def _llm(server: RunningTriton, prompt: str, images: list[str]):
    return server.grpc_stream("llm", {"text_input": prompt, "sampling_parameters": GREEDY, "stream": True,
                                      "image": images})


def _served_on(server: RunningTriton) -> None:
    """A good image request still succeeds and, once done, no block is held."""
    ok = _llm(server, PROMPT, [GOOD])
    assert ok.error is None and ok.texts()
    server.wait_idle()


@pytest.mark.parametrize("case", list(LLM_CASES))
def test_the_llm_models_image_input_refuses_each_naming_the_field(vlm_server, case):
    prompt, images, field = LLM_CASES[case]
    result = _llm(vlm_server, prompt, images)
    assert result.error is not None, case
    assert f"field={field}" in str(result.error), (case, result.error)
    _served_on(vlm_server)


def test_an_image_on_a_text_only_model_is_refused_naming_images(small_pool_server):
    result = small_pool_server.grpc_stream("llm", {"text_input": "Hello", "sampling_parameters": GREEDY,
                                                   "stream": True, "image": [GOOD]})
    assert result.error is not None and "field=images" in str(result.error)
    ok = small_pool_server.grpc_stream("llm", {"text_input": "Hello", "sampling_parameters": GREEDY})
    assert ok.error is None
    small_pool_server.wait_idle()


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(*parts: dict) -> dict:
    return {"model": "vlm", "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Look: "}, *parts]}]}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# name: (chat body of the shim's URL, param)
SHIM_CASES = {
    "bytes that are not an image": (lambda url: _chat(_part("data:image/png;base64," + _b64(b"not an image"))),
                                    "messages"),
    "a decompression bomb": (lambda url: _chat(_part("data:image/png;base64," + _b64(_bomb()))), "messages"),
    "more images than limit_mm_per_prompt": (lambda url: _chat(*[_part("data:image/png;base64," + GOOD)] * 3),
                                             "messages"),
    "a URL to a host not allowed": (lambda url: _chat(_part(f"http://127.0.0.1:{_port(url)}/v1/models")),
                                    "messages[0].content[1].image_url.url"),
    "an allowed name on a loopback address": (lambda url: _chat(_part(f"http://localhost:{_port(url)}/x.png")),
                                              "messages[0].content[1].image_url.url"),
    "a URL that is neither data nor http": (lambda url: _chat(_part("file:///etc/passwd")),
                                            "messages[0].content[1].image_url.url"),
    "an unknown content-part type": (lambda url: _chat({"type": "input_audio", "input_audio": {"data": "AA=="}}),
                                     "messages[0].content[1]"),
}


@pytest.mark.parametrize("case", list(SHIM_CASES))
def test_the_shim_refuses_each_bad_image_part_naming_its_param(vlm_server, vlm_shim, case):
    body, param = SHIM_CASES[case]
    response = httpx.post(f"{vlm_shim}/v1/chat/completions", json=body(vlm_shim), timeout=60)
    assert response.status_code == 400, (case, response.text)
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", (case, error)
    good = httpx.post(f"{vlm_shim}/v1/chat/completions", json=_chat(_part("data:image/png;base64," + GOOD)),
                      timeout=60)
    assert good.status_code == 200, good.text
    vlm_server.wait_idle()

