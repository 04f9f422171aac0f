"""The shim's http(s) image_url fetch (client/openai/media.py) against a local http.server on loopback, which each
test allows explicitly (127.0.0.1 listed): the bytes arrive as sent; a host not listed, a listed name that resolves
to a loopback address, a body over the size limit (with and without Content-Length), a slow server, an HTTP error
and a redirect are each refused naming the part's url; more images than limit_mm_per_prompt are refused naming
`messages` before anything is fetched. And the flags, as `serve` hands them to the shim."""

from __future__ import annotations

import argparse
import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedserve.client.media_options import add_media_arguments, image_limit, media_shim_flags
from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.media import MediaSettings, resolve_images

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
PARAM = "messages[0].content[1].image_url.url"
LOOPBACK = MediaSettings(allowed_domains=("127.0.0.1",), fetch_timeout_s=2.0, max_bytes=4096)


class _Handler(BaseHTTPRequestHandler):
    fetched: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        _Handler.fetched.append(self.path)
        if self.path == "/slow.png":
            time.sleep(1.5)
        if self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        if self.path not in ("/cat.png", "/slow.png", "/big.png", "/big-unsized.png"):
            self.send_error(404)
            return
        body = IMAGE * 4 if self.path.startswith("/big") else IMAGE
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big-unsized.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the shim hung up past its limit
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _resolve(urls: list[str], settings: MediaSettings) -> list[str]:
    return asyncio.run(resolve_images(urls, [f"messages[0].content[{i + 1}].image_url.url" for i in range(len(urls))],
                                      settings))


def test_an_allowed_loopback_url_is_fetched_beside_data_payloads(base):
    data = base64.b64encode(b"GIF89a").decode()
    images = asyncio.run(resolve_images([data, f"{base}/cat.png"], ["a", PARAM], LOOPBACK))
    assert images[0] == data and base64.b64decode(images[1]) == IMAGE


@pytest.mark.parametrize(("path", "settings", "words"), [
    ("/cat.png", MediaSettings(allowed_domains=("example.com",)), "not in --allowed-media-domains"),
    ("/cat.png", MediaSettings(allowed_domains=("10.0.0.0/8",)), "not in --allowed-media-domains"),
    ("/big.png", LOOPBACK, "over 4096 bytes"),
    ("/big-unsized.png", LOOPBACK, "over 4096 bytes"),
    ("/slow.png", MediaSettings(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.3), "within 0.3 s"),
    ("/missing.png", LOOPBACK, "HTTP 404"),
    ("/redirect.png", LOOPBACK, "HTTP 302"),
])
def test_each_bad_fetch_is_refused_naming_the_url(base, path, settings, words):
    with pytest.raises(APIError, match=words) as info:
        _resolve([f"{base}{path}"], settings)
    assert info.value.status == 400 and info.value.param == PARAM


def test_a_listed_name_that_resolves_to_loopback_is_refused_unless_the_address_is_listed(base):
    url = base.replace("127.0.0.1", "localhost") + "/cat.png"
    before = len(_Handler.fetched)
    with pytest.raises(APIError, match="loopback, private or reserved") as info:
        _resolve([url], MediaSettings(allowed_domains=("localhost",)))
    assert info.value.param == PARAM and len(_Handler.fetched) == before  # refused before connecting
    both = MediaSettings(allowed_domains=("localhost", "127.0.0.1", "::1"), fetch_timeout_s=2.0)
    assert base64.b64decode(_resolve([url], both)[0]) == IMAGE


def test_more_images_than_the_limit_are_refused_before_any_fetch(base):
    before = len(_Handler.fetched)
    with pytest.raises(APIError, match="at most 2 image") as info:
        _resolve([f"{base}/cat.png"] * 3, MediaSettings(allowed_domains=("127.0.0.1",), image_limit=2))
    assert info.value.param == "messages" and len(_Handler.fetched) == before


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_media_arguments(parser)
    return parser


def test_serve_hands_the_media_flags_to_the_shim_as_given():
    args = _parser().parse_args(["--allowed-media-domains", "example.com", "127.0.0.1", "--limit-mm-per-prompt",
                                 '{"image": 3}', "--media-fetch-timeout", "2.5", "--media-max-bytes", "1000"])
    shim_args = _parser().parse_args(media_shim_flags(args))
    assert vars(shim_args) == vars(args) and image_limit(shim_args) == 3
    assert image_limit(_parser().parse_args([])) == 16 and media_shim_flags(_parser().parse_args([])) == []


@pytest.mark.parametrize("value", ['{"image": 17}', '{"video": 1}', '{"image": -1}', "[1]", "image=2"])
def test_bad_limit_mm_per_prompt_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit):
        argparse_parser = argparse.ArgumentParser()
        add_media_arguments(argparse_parser)
        argparse_parser.parse_args(["--limit-mm-per-prompt", value])
    assert "--limit-mm-per-prompt" in capsys.readouterr().err


def test_pagedserve_serve_takes_the_media_flags_and_starts_its_shim_with_them():
    from pagedserve.client import launcher
    from pagedserve.client.openai.main import add_arguments as shim_arguments

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--allowed-media-domains", "images.example.com", "--limit-mm-per-prompt",
                              '{"image": 1}'])
    flags = launcher._tool_flags(args)
    assert flags == ["--allowed-media-domains", "images.example.com", "--limit-mm-per-prompt", '{"image": 1}']
    shim = argparse.ArgumentParser()
    shim_arguments(shim)
    shim_args = shim.parse_args(flags)
    assert shim_args.allowed_media_domains == ["images.example.com"] and image_limit(shim_args) == 1
