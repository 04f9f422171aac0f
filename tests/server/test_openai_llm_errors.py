"""The llm model's and Triton's errors as OpenAI errors: status, type, code and param come from the wire
tag the llm model writes (kind, field), never from the message's words (no server needed)."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.errors import (
    ErrorKind,
    InvalidRequestError,
    RequestTimeoutError,
    ServerBusyError,
    ShuttingDownError,
    to_wire,
)
from pagedserve.client.openai.errors import triton_api_error
from pagedserve.client.openai.protocol import parse_chat_request, parse_completion_request
from pagedserve.client.triton_client import TritonRequestError, TritonUnavailableError


def _mapped(error: BaseException, renames: dict[str, str] | None = None):
    return triton_api_error(TritonRequestError(to_wire(error)), renames)


@pytest.mark.parametrize(
    "error, status, param, code, message",
    [
        (ServerBusyError("server busy: 4096 requests already waiting"), 503, None, "server_busy",
         "server busy: 4096 requests already waiting"),
        (ShuttingDownError("the llm model is shutting down"), 503, None, "server_busy",
         "the llm model is shutting down"),
        (InvalidRequestError("prompt of 300 tokens plus max_tokens 16 exceeds max_model_len 256", "prompt"),
         400, "prompt", None, "prompt of 300 tokens plus max_tokens 16 exceeds max_model_len 256"),
        (InvalidRequestError("top_p must be in (0, 1], got 1.5", "top_p"), 400, "top_p", None,
         "top_p must be in (0, 1], got 1.5"),
        (RequestTimeoutError("request timeout expired"), 504, None, "timeout", "request timeout expired"),
        # A server fault is a 500, never the client's fault.
        (RuntimeError("engine step failed: RuntimeError('boom')"), 500, None, "internal_error",
         "internal error: engine step failed: RuntimeError('boom')"),
    ],
)
def test_llm_errors_map_to_openai_status_and_param(error, status, param, code, message):
    api_error = _mapped(error)
    assert (api_error.status, api_error.param, api_error.code) == (status, param, code)
    assert api_error.body()["error"]["message"] == message
    assert api_error.body()["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")


def test_the_kind_decides_the_status_whatever_the_words_say():
    refusal = _mapped(InvalidRequestError("stop must not say busy, unavailable or shutting down", "stop"))
    assert (refusal.status, refusal.param) == (400, "stop")
    busy = _mapped(ServerBusyError("come back later"))
    assert (busy.status, busy.code) == (503, "server_busy")
    fault = _mapped(RuntimeError("top_p must be in (0, 1]"))
    assert (fault.status, fault.param) == (500, None)


@pytest.mark.parametrize(
    "field, param",
    [
        ("text_input", "prompt"),
        ("input_ids", "prompt"),
        ("prompt_token_ids", "prompt"),
        ("max_tokens", "max_tokens"),
        ("stop", "stop"),
        ("logprobs", "logprobs"),
        ("temperature", "temperature"),
        ("min_tokens", "min_tokens"),
        # Engine fields OpenAI has no name for.
        ("beam_width", None),
        ("request_id", None),
        ("sampling_parameters", None),
    ],
)
def test_the_refused_field_becomes_the_openai_param(field, param):
    api_error = _mapped(InvalidRequestError("is refused", field))
    assert (api_error.status, api_error.param) == (400, param)
    assert api_error.message == f"{field}: is refused"


def test_a_refusal_names_the_field_as_the_request_sent_it():
    chat = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 2})
    too_long = _mapped(InvalidRequestError("max_tokens must be at most 8", "max_tokens"), chat.param_renames)
    assert (too_long.param, too_long.message) == ("max_completion_tokens", "max_completion_tokens must be at most 8")
    logprobs = _mapped(InvalidRequestError("logprobs must be <= 20, got 25", "logprobs"), chat.param_renames)
    assert logprobs.param == "top_logprobs"
    completion = parse_completion_request({"model": "m", "prompt": "x", "echo": True, "logprobs": 2})
    prompt_logprobs = _mapped(InvalidRequestError("prompt_logprobs is not supported with beam search",
                                                  "prompt_logprobs"), completion.param_renames)
    assert prompt_logprobs.param == "logprobs"


@pytest.mark.parametrize("message", [
    "Request for unknown model: 'llm' is not found",
    "[request id: cmpl-1-0] unexpected shape for input 'text_input' for model 'llm'",
    # Words alone never make a refusal: without the tag this is not the llm model's.
    "top_p must be in (0, 1], got 1.5",
])
def test_an_untagged_error_is_tritons_own_refusal_of_what_the_shim_sent_a_503(message):
    api_error = triton_api_error(TritonRequestError(message))
    assert (api_error.status, api_error.param, api_error.code) == (503, None, "triton_error")
    assert api_error.message == message and api_error.body()["error"]["type"] == "server_error"


def test_unreachable_triton_is_503():
    api_error = triton_api_error(TritonUnavailableError("tritonserver at 127.0.0.1:9: connection refused"))
    assert api_error.status == 503 and api_error.body()["error"]["type"] == "server_error"


def test_every_error_kind_of_the_llm_model_has_an_openai_answer():
    # A new kind must be given a status here, or the shim would fail on it with a KeyError.
    samples = {ErrorKind.INVALID_ARGUMENT: InvalidRequestError("x", "prompt"), ErrorKind.BUSY: ServerBusyError("x"),
               ErrorKind.SHUTTING_DOWN: ShuttingDownError("x"), ErrorKind.TIMEOUT: RequestTimeoutError("x"),
               ErrorKind.INTERNAL: RuntimeError("x")}
    assert set(samples) == set(ErrorKind)
    for error in samples.values():
        assert 400 <= _mapped(error).status < 600
