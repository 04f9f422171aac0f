"""Building Triton response tensors and error responses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.backend.core.errors import ErrorKind, error_kind, to_wire

# TritonError's codes by attribute name: pb_utils gains TritonError only once the stub is running.
_TRITON_CODES = {
    ErrorKind.INVALID_ARGUMENT: "INVALID_ARG",
    ErrorKind.BUSY: "UNAVAILABLE",
    ErrorKind.SHUTTING_DOWN: "UNAVAILABLE",
    ErrorKind.TIMEOUT: "UNAVAILABLE",  # what Triton's own queue answers a request whose timeout passed
    ErrorKind.INTERNAL: "INTERNAL",
}


def error_response(error: BaseException) -> Any:
    """An InferenceResponse carrying `error` with the status a client should see and the wire tag the
    OpenAI shim reads its kind and field from."""
    code = getattr(pb_utils.TritonError, _TRITON_CODES[error_kind(error)])
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(to_wire(error), code))


def string_tensor(name: str, values: Sequence[str]) -> Any:
    """A STRING tensor of UTF-8 encoded values."""
    return pb_utils.Tensor(name, np.array([v.encode("utf-8") for v in values], dtype=np.object_))


class TritonResponses:
    """The llm model's responses as pb_utils objects: the ResponseFactory of its response threads."""

    def output(self, tensors: list) -> Any:
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def error(self, error: BaseException) -> Any:
        return error_response(error)

    def cancelled(self) -> Any:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
            "the request was cancelled", pb_utils.TritonError.CANCELLED))

    def control(self, answer: dict) -> Any:
        """A lora_control answer: the JSON object in text_output."""
        return self.output([string_tensor("text_output", [json.dumps(answer)])])
