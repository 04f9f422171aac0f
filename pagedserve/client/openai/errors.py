"""OpenAI's error shape, and how the llm model's and Triton's errors become it.

The llm model tags every error message with its kind and field (pagedserve/backend/core/errors.py `to_wire`): the
kind decides the status, the field the `param`; the human words before the tag are the message, never read.
"""

from __future__ import annotations

from pagedserve.backend.core.errors import ErrorKind, from_wire
from pagedserve.client.openai.fields import openai_param
from pagedserve.client.triton_client import TritonRequestError, TritonUnavailableError

TRITON_ERRORS = (TritonRequestError, TritonUnavailableError)

# Status and OpenAI `code` of each kind of llm error but a refusal (a 400 naming its param).
_STATUS_AND_CODE = {
    ErrorKind.BUSY: (503, "server_busy"),
    ErrorKind.SHUTTING_DOWN: (503, "server_busy"),
    ErrorKind.TIMEOUT: (504, "timeout"),
    ErrorKind.INTERNAL: (500, "internal_error"),
}


class APIError(Exception):
    """An error answered in OpenAI's JSON shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The JSON body OpenAI sends for this error."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None) -> APIError:
    """A 400 invalid_request_error about `param`."""
    return APIError(400, message, param)


def refusal(message: str, engine_field: str | None, renames: dict[str, str]) -> APIError:
    """A 400 for an engine refusal of `engine_field`, named as the request named it: a field the request
    renamed (chat's `max_completion_tokens`) is renamed in the message's leading word too."""
    param = openai_param(engine_field, renames)
    if engine_field in renames and message.startswith(engine_field):
        message = renames[engine_field] + message[len(engine_field):]
    return bad_request(message, param)


def triton_api_error(error: Exception, renames: dict[str, str] | None = None) -> APIError:
    """The OpenAI error of a failed llm request: Triton unreachable is 503, a tagged llm error maps by its
    kind; an untagged one is Triton's own refusal of the request the shim built (the llm model unloaded,
    say), so the service, not the caller, is at fault: 503."""
    if isinstance(error, TritonUnavailableError):
        return APIError(503, str(error), code="triton_unavailable")
    wire = from_wire(str(error))
    if wire is None:
        return APIError(503, str(error), code="triton_error")
    if wire.kind is ErrorKind.INVALID_ARGUMENT and wire.field == "lora_name":
        # The adapter the `model` field named is not (or no longer) served: vLLM's unknown model.
        return APIError(404, wire.message, "model", "model_not_found")
    if wire.kind is ErrorKind.INVALID_ARGUMENT:
        return refusal(wire.message, wire.field, renames or {})
    status, code = _STATUS_AND_CODE[wire.kind]
    return APIError(status, wire.message, code=code)
