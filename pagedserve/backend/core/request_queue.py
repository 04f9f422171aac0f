"""The scheduler's waiting queue, one class per scheduling policy, with one small interface.

Finished (aborted) requests are not removed when they finish: they stay queued until they reach the head
or a `compact()`, so ending a waiting request is O(1).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedserve.backend.core.request import Request


class FCFSQueue:
    """Requests in the order they were queued; a preempted one rejoins at the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """Queue a new request at the back."""
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        """Queue a preempted request at the front: it was admitted before everyone waiting."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The next request to admit."""
        return self._queue[0]

    def pop(self) -> Request:
        """Take the next request to admit."""
        return self._queue.popleft()

    def compact(self) -> None:
        """Drop the finished requests still queued."""
        self._queue = deque(r for r in self._queue if not r.is_finished)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Requests by (priority, arrival_time), then the order they were queued: a heap, so a preempted
    request takes the place its own priority and arrival give it."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def add(self, request: Request) -> None:
        """Queue a request at its place; a preempted one too."""
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._order), request))

    add_preempted = add

    def peek(self) -> Request:
        """The next request to admit."""
        return self._heap[0][3]

    def pop(self) -> Request:
        """Take the next request to admit."""
        return heapq.heappop(self._heap)[3]

    def compact(self) -> None:
        """Drop the finished requests still queued."""
        self._heap = [entry for entry in self._heap if not entry[3].is_finished]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In the order they would be popped."""
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def priority_key(request: Request) -> tuple[int, float]:
    """Where a request stands under the priority policy: lower sorts first."""
    return request.priority, request.arrival_time
