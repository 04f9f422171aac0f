"""Errors that cross module boundaries; each maps to one client-visible status."""

from __future__ import annotations

# How an INTERNAL error response's message starts: a streamed gRPC error carries no status code, so a client
# (the OpenAI shim) tells a server fault from a refused request by it.
INTERNAL_ERROR_PREFIX = "internal error: "


class PagedServeError(Exception):
    """Base class of every error pagedserve raises on purpose."""


class InvalidRequestError(PagedServeError, ValueError):
    """Bad user input (INVALID_ARG / HTTP 400); `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ServerBusyError(PagedServeError):
    """The waiting queue is full (UNAVAILABLE / HTTP 503); the client may retry later."""


class ShuttingDownError(PagedServeError):
    """The model is being unloaded or the server is stopping (UNAVAILABLE / HTTP 503); retry elsewhere."""
