"""Errors that cross module boundaries, and how they cross the llm model -> client boundary.

A streamed gRPC error carries only its message (no status code), so every error response of the llm model
ends with a machine-readable tag, ` [kind=invalid_argument field=top_p]`, written by `to_wire` and read back
by `from_wire`: clients (the OpenAI shim) map the kind to a status and the field to a `param` without
reading the human words before it, which stay as Triton's own clients know them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from urllib.parse import quote, unquote

# How an INTERNAL error response's human message starts.
INTERNAL_ERROR_PREFIX = "internal error: "


class PagedServeError(Exception):
    """Base class of every error pagedserve raises on purpose."""


class InvalidRequestError(PagedServeError, ValueError):
    """Bad user input (INVALID_ARG / HTTP 400); `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ConfigError(InvalidRequestError):
    """A bad engine setting (a config field, a from_pretrained option, an llm config.pbtxt parameter); `field`
    names it. It is an invalid argument to whoever gave it, so it reads as one on the wire (kind
    invalid_argument, the field in the tag); at model load it fails the load, its message naming the field."""


class ServerBusyError(PagedServeError):
    """The waiting queue is full (UNAVAILABLE / HTTP 503); the client may retry later."""


class ShuttingDownError(PagedServeError):
    """The model is being unloaded or the server is stopping (UNAVAILABLE / HTTP 503); retry elsewhere."""


class RequestTimeoutError(PagedServeError):
    """The request's own timeout passed before it finished (UNAVAILABLE, as Triton's queue timeout is)."""


class ErrorKind(str, Enum):
    """What went wrong, as a client needs to know it to answer its own caller."""

    INVALID_ARGUMENT = "invalid_argument"
    BUSY = "busy"
    SHUTTING_DOWN = "shutting_down"
    TIMEOUT = "timeout"
    INTERNAL = "internal"


def error_kind(error: BaseException) -> ErrorKind:
    """The kind of an exception raised anywhere in the server; anything unplanned is INTERNAL."""
    if isinstance(error, InvalidRequestError):
        return ErrorKind.INVALID_ARGUMENT
    if isinstance(error, ServerBusyError):
        return ErrorKind.BUSY
    if isinstance(error, ShuttingDownError):
        return ErrorKind.SHUTTING_DOWN
    if isinstance(error, RequestTimeoutError):
        return ErrorKind.TIMEOUT
    return ErrorKind.INTERNAL


_ERRORS_BY_KIND: dict[ErrorKind, type[Exception]] = {
    ErrorKind.INVALID_ARGUMENT: InvalidRequestError,
    ErrorKind.BUSY: ServerBusyError,
    ErrorKind.SHUTTING_DOWN: ShuttingDownError,
    ErrorKind.TIMEOUT: RequestTimeoutError,
}


def error_of_kind(kind: ErrorKind | None, message: str) -> Exception:
    """An exception of `kind` saying `message` (a RuntimeError for INTERNAL or None): how an engine output's
    error (`RequestOutput.error`, `.error_kind`) is answered."""
    return _ERRORS_BY_KIND.get(kind, RuntimeError)(message)


@dataclass(frozen=True)
class WireError:
    """An error as read back from its wire message."""

    kind: ErrorKind
    message: str
    field: str | None = None


_TAG = re.compile(r" \[kind=(?P<kind>[a-z_]+)(?: field=(?P<field>[^\] ]+))?\]$")


def human_message(error: BaseException) -> str:
    """The message Triton's clients read: a refusal starts with its field, a server fault says so."""
    message = str(error)
    kind = error_kind(error)
    field = getattr(error, "field", None)
    if kind is ErrorKind.INVALID_ARGUMENT and field and not message.startswith(field):
        message = f"{field}: {message}"
    elif kind is ErrorKind.INTERNAL and not message.startswith(INTERNAL_ERROR_PREFIX):
        message = INTERNAL_ERROR_PREFIX + message
    return message


def to_wire(error: BaseException) -> str:
    """The human message followed by the machine-readable tag `from_wire` reads."""
    kind = error_kind(error)
    field = getattr(error, "field", None) if kind is ErrorKind.INVALID_ARGUMENT else None
    tag = f"kind={kind.value}" + (f" field={quote(field, safe='')}" if field else "")
    return f"{human_message(error)} [{tag}]"


def from_wire(text: str) -> WireError | None:
    """The kind, field and human message of a `to_wire` message; None for a message without the tag
    (an error of Triton's own, such as an unknown model or a bad tensor shape)."""
    match = _TAG.search(text)
    if match is None:
        return None
    try:
        kind = ErrorKind(match["kind"])
    except ValueError:
        return None
    field = unquote(match["field"]) if match["field"] else None
    return WireError(kind, text[: match.start()], field)


def json_object(value: object, name: str, error: type[InvalidRequestError] = InvalidRequestError) -> dict:
    """`value` as a JSON object: a dict as it is, a str parsed; anything else refused with `error` naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as reason:
            raise error(f"{name} is not valid JSON: {reason}", name) from None
    if not isinstance(value, dict):
        raise error(f"{name} must be a JSON object, got {type(value).__name__}", name)
    return value
