"""The Responses API's in-memory store: each stored response with the chat history that continues it, bounded
in entries (the oldest is evicted when full) and in age (an entry older than the bound is gone, as if it had
never been stored); responses still running are kept so that `cancel` can reach them."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.client.openai.errors import APIError

DEFAULT_STORE_SIZE = 1024
DEFAULT_STORE_MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    """A response body (as GET returns it) and the messages a continuation renders before its new input."""

    body: dict
    history: list[dict]
    stored_at: float
    cancelled: bool = False  # cancel was asked while it ran


@dataclass
class ResponseStore:
    """At most `size` responses, each kept `max_age_s` seconds; oldest first."""

    size: int = DEFAULT_STORE_SIZE
    max_age_s: float = DEFAULT_STORE_MAX_AGE_S
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.size < 1 or self.max_age_s <= 0:
            raise ValueError("the response store needs a size >= 1 and a max age > 0")

    def put(self, body: dict, history: list[dict]) -> StoredResponse:
        """Store (or replace) a response; the oldest entries go when the store is over its size."""
        self._expire()
        self._entries.pop(body["id"], None)
        entry = StoredResponse(body, history, self.clock())
        self._entries[body["id"]] = entry
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return entry

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 404 in OpenAI's shape when it is unknown, expired or evicted."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found (never stored, deleted, or older than "
                                f"the store keeps)", param=param, code="response_not_found")
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def discard(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        limit = self.clock() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at >= limit:
                break
            self._entries.popitem(last=False)
