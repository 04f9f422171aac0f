"""The error tag that carries an error's kind and field across the llm model -> client boundary."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.errors import (
    INTERNAL_ERROR_PREFIX,
    ErrorKind,
    InvalidRequestError,
    RequestTimeoutError,
    ServerBusyError,
    ShuttingDownError,
    error_kind,
    error_of_kind,
    from_wire,
    to_wire,
)


@pytest.mark.parametrize(("error", "kind", "field", "human"), [
    (InvalidRequestError("top_p must be in (0, 1], got 1.5", "top_p"), ErrorKind.INVALID_ARGUMENT, "top_p",
     "top_p must be in (0, 1], got 1.5"),
    (InvalidRequestError("give either text_input or input_ids, not both", "input_ids"),
     ErrorKind.INVALID_ARGUMENT, "input_ids", "input_ids: give either text_input or input_ids, not both"),
    (InvalidRequestError("unknown sampling parameter 'a b]'", "a b] x=1"), ErrorKind.INVALID_ARGUMENT,
     "a b] x=1", "a b] x=1: unknown sampling parameter 'a b]'"),
    (InvalidRequestError("no field named"), ErrorKind.INVALID_ARGUMENT, None, "no field named"),
    (ServerBusyError("server busy: 4 requests already waiting"), ErrorKind.BUSY, None,
     "server busy: 4 requests already waiting"),
    (ShuttingDownError("the llm model is shutting down"), ErrorKind.SHUTTING_DOWN, None,
     "the llm model is shutting down"),
    (RequestTimeoutError("request timeout expired: the request did not finish within its timeout of 2 s"),
     ErrorKind.TIMEOUT, None, "request timeout expired: the request did not finish within its timeout of 2 s"),
    (RuntimeError("engine step failed: boom"), ErrorKind.INTERNAL, None,
     INTERNAL_ERROR_PREFIX + "engine step failed: boom"),
])
def test_kind_field_and_human_message_survive_the_wire(error, kind, field, human):
    wire = to_wire(error)
    assert wire.startswith(human)
    read = from_wire(wire)
    assert (read.kind, read.field, read.message) == (kind, field, human)
    # Triton's clients may see it behind their own prefix; the tag is still read from the end.
    assert from_wire("[StatusCode.INVALID_ARGUMENT] " + wire).kind is kind


@pytest.mark.parametrize("text", [
    "unexpected shape for input 'max_tokens' for model 'llm'",
    "Request for unknown model: 'nope' is not found",
    "something [kind=not_a_kind]",
    "",
])
def test_a_message_without_our_tag_is_not_read_as_ours(text):
    assert from_wire(text) is None


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_an_engine_outputs_error_kind_becomes_an_exception_of_that_kind(kind):
    assert error_kind(error_of_kind(kind, "it failed")) is kind
    assert str(error_of_kind(kind, "it failed")) == "it failed"
