"""Async plumbing of one request: its llm streams merged into one, and its work cancelled when the HTTP
client goes away (cancelling a stream cancels its Triton request, which frees its KV blocks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from pagedserve.client.triton_client import LLMResponse

T = TypeVar("T")
DISCONNECT_POLL_SECONDS = 0.1


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class Disconnectable(Protocol):
    """What `unless_disconnected` needs of an HTTP request (starlette's Request has it)."""

    async def is_disconnected(self) -> bool: ...


async def merge_streams(streams: list[AsyncIterator[LLMResponse]]) -> AsyncIterator[tuple[int, LLMResponse]]:
    """Interleave several response streams as items arrive; closing the merge cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[LLMResponse]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as error:
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Disconnectable) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


async def unless_disconnected(request: Disconnectable, work: Awaitable[T]) -> T:
    """Await `work` but cancel it (and so its Triton requests) if the HTTP client goes away."""
    task: asyncio.Future[Any] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
