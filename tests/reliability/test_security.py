"""What the README's Security section promises: loopback-only listeners unless --host says otherwise, a
constant-time API-key check, request text never evaluated as a template nor used as a path."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pagedserve.client import launcher
from pagedserve.client import openai as openai_shim
from pagedserve.client.openai import app as shim_app
from pagedserve.client.openai.app import create_app
from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.shim import ShimSettings

# 127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp[6] write them.
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listen_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp[6]) of sockets listening on `port`."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                addresses.add(address)
    return addresses


def _port(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1].split("/")[0])


@pytest.mark.slow
def test_tritonserver_and_the_shim_listen_on_loopback_only(small_pool_server, shim_url):
    ports = [_port(small_pool_server.http_url), _port(small_pool_server.grpc_url),
             _port(small_pool_server.metrics_url.removesuffix("/metrics")), _port(shim_url)]
    for port in ports:
        addresses = _listen_addresses(port)
        assert addresses and addresses <= LOOPBACK_HEX, (port, addresses)


def test_every_listener_defaults_to_loopback_and_opening_up_is_an_explicit_host(tmp_path):
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert parser.parse_args([]).host == "127.0.0.1"
    assert parser.parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
    shim_parser = argparse.ArgumentParser()
    openai_shim.add_arguments(shim_parser)
    assert shim_parser.parse_args([]).host == "127.0.0.1"
    command = launcher.TritonServer(tmp_path / "repo", work_dir=tmp_path).command()
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in command


def test_api_key_is_compared_in_constant_time(monkeypatch):
    compared = []

    def recording_compare_digest(a, b):
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(shim_app.hmac, "compare_digest", recording_compare_digest)
    app = create_app(ShimSettings(triton_url="127.0.0.1:9", model_name="tiny", api_key="s3cret"))
    with TestClient(app) as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer guess"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert compared == [(b"guess", b"s3cret"), (b"s3cret", b"s3cret")]


def test_message_text_is_never_rendered_as_a_template():
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    hostile = "{{ 7 * 7 }} {% for c in ''.__class__.__mro__ %}{{ c }}{% endfor %}"
    rendered = template.render([{"role": "user", "content": hostile}], add_generation_prompt=False)
    assert rendered == f"[user] {hostile}\n"


def test_a_template_reaching_for_python_internals_is_refused():
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(APIError):
        template.render([{"role": "user", "content": "hi"}])


def test_a_model_name_that_looks_like_a_path_is_just_an_unknown_model():
    app = create_app(ShimSettings(triton_url="127.0.0.1:9", model_name="tiny"))
    with TestClient(app) as client:
        for name in ("../../etc/passwd", "/etc/passwd", "tiny/../../.."):
            reply = client.post("/v1/chat/completions",
                                json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
