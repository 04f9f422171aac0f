"""HTTP-level errors of the OpenAI shim that are decided before Triton is asked (no server needed)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedserve.client.openai.app import create_app
from pagedserve.client.openai.shim import ShimSettings

# Nothing listens there: every case below must be answered by the shim itself.
UNREACHABLE = "127.0.0.1:9"


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = create_app(ShimSettings(triton_url=UNREACHABLE, model_name="tiny", max_body_bytes=2048))
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def keyed_client() -> TestClient:
    app = create_app(ShimSettings(triton_url=UNREACHABLE, model_name="tiny", api_key="s3cret"))
    with TestClient(app) as test_client:
        yield test_client


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_unknown_model_is_404_model_not_found(client):
    error = _error(client.get("/v1/models/gpt-4"), 404)
    assert error["code"] == "model_not_found"
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
    ]:
        error = _error(client.post(path, json=body), 404)
        assert (error["param"], error["code"]) == ("model", "model_not_found")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"model": "tiny"}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function.name"),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
         "max_completion_tokens"),
    ],
)
def test_bad_request_is_400_naming_the_field(client, path, body, param):
    error = _error(client.post(path, json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]


def test_body_that_is_not_a_json_object_is_400(client):
    _error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(client.post("/v1/completions", json=[1, 2]), 400)


def test_oversized_body_is_413(client):
    error = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 4096}), 413)
    assert "2048" in error["message"]


def test_api_key_is_required_on_v1_when_configured(keyed_client):
    assert _error(keyed_client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert _error(keyed_client.get("/v1/models", headers=wrong), 401)["code"] == "invalid_api_key"
    ok = keyed_client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
    body = {"model": "tiny", "prompt": "x"}
    assert _error(keyed_client.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"


def test_triton_down_reports_unhealthy_and_503(client):
    assert client.get("/health").status_code == 503
    error = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}), 503)
    assert error["type"] == "server_error"


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/audio/speech"),  # /v1/responses is served now (issue 33)
    ("POST", "/v1/images/generations"),  # /v1/embeddings is served now (issue 32)
    ("POST", "/v1/chat/completion"),
    ("GET", "/v1/nothing/here"),
])
def test_unknown_route_is_openai_404(client, method, path):
    error = _error(client.request(method, path, json={"model": "tiny"}), 404)
    assert error["type"] == "invalid_request_error" and path in error["message"]
    assert error["code"] == "not_found"


def test_wrong_method_is_openai_405(client):
    error = _error(client.get("/v1/completions"), 405)
    assert error["type"] == "invalid_request_error" and "/v1/completions" in error["message"]
