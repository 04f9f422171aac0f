"""Bad requests to the real server: each gets a clear error naming the field, and nothing else is
disturbed (the next good request succeeds)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

GOOD = {"text_input": "Hello", "max_tokens": 3, "temperature": 0}
TOO_LONG_PROMPT = "the quick brown fox " * 200  # far more than max_model_len (256) tokens

BAD_HTTP_REQUESTS = {
    "missing text_input": ({"max_tokens": 3}, "text_input"),
    "empty text_input": ({"text_input": ""}, "text_input"),
    "malformed sampling_parameters JSON": ({"text_input": "Hi", "sampling_parameters": "{max_tokens: 3"},
                                           "sampling_parameters"),
    "sampling_parameters not an object": ({"text_input": "Hi", "sampling_parameters": "[1, 2]"},
                                          "sampling_parameters"),
    "max_tokens zero": ({"text_input": "Hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative in JSON": ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": -4}'}, "max_tokens"),
    "negative temperature": ({"text_input": "Hi", "temperature": -0.5}, "temperature"),
    "top_p above one": ({"text_input": "Hi", "top_p": 1.5}, "top_p"),
    "unknown sampling key": ({"text_input": "Hi", "sampling_parameters": '{"temprature": 0.5}'}, "temprature"),
    "prompt longer than max_model_len": ({"text_input": TOO_LONG_PROMPT, "max_tokens": 4}, "max_model_len"),
}


@pytest.mark.parametrize("body, field", BAD_HTTP_REQUESTS.values(), ids=BAD_HTTP_REQUESTS.keys())
def test_bad_http_request_gets_400_naming_the_field_and_the_next_request_succeeds(triton_server, body, field):
    status, text = triton_server.post("/v2/models/llm/generate", body)
    assert status == 400, text
    assert field in text
    assert triton_server.generate("llm", GOOD)["text_output"].startswith("Hello")


def test_non_utf8_text_input_gets_invalid_argument_over_grpc(triton_server):
    result = triton_server.grpc_stream("llm", {"text_input": b"caf\xe9 \xff\xfe", "stream": True})
    assert result.error is not None and result.responses == []
    # Stream errors carry only the message (no status code) over gRPC.
    assert "text_input is not valid UTF-8" in str(result.error)
    good = triton_server.grpc_stream("llm", {"text_input": "café", "sampling_parameters": {"max_tokens": 2}})
    assert good.error is None and good.texts()[0].startswith("café")


def test_bad_streaming_request_ends_with_one_error_and_no_data(triton_server):
    result = triton_server.grpc_stream(
        "llm", {"text_input": "Hi", "stream": True, "sampling_parameters": {"top_p": 0}}
    )
    assert result.responses == []
    assert "top_p" in str(result.error)


def test_bad_ensemble_input_names_the_ensemble_field(triton_server):
    status, text = triton_server.post("/v2/models/ensemble/generate",
                                      {"text_input": "Hi", "num_return_sequences": 2})
    assert status == 400 and "num_return_sequences" in text
    assert triton_server.generate("ensemble", GOOD)["text_output"].startswith("Hello")
