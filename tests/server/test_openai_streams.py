"""One request's async plumbing: its llm streams merged, its work cancelled when the HTTP client goes away."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.client.openai.streams import ClientGone, merge_streams, unless_disconnected
from pagedserve.client.triton_client import LLMResponse


def test_non_streamed_work_is_cancelled_when_the_client_disconnects():
    class GoneAfterTwoPolls:
        polls = 0

        async def is_disconnected(self) -> bool:
            self.polls += 1
            return self.polls > 2

    cancelled = []

    async def endless_generation():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(ClientGone):
        asyncio.run(unless_disconnected(GoneAfterTwoPolls(), endless_generation()))
    assert cancelled == [True]


def test_merged_streams_close_every_source_when_the_reader_stops():
    closed = []

    async def source(index: int):
        try:
            for step in range(1000):
                yield LLMResponse([f"{index}:{step}"], [None])
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    async def read_three():
        merged = merge_streams([source(0), source(1)])
        items = [item async for _, item in _take(merged, 3)]
        await merged.aclose()
        return items

    async def _take(stream, count):
        async for item in stream:
            yield item
            count -= 1
            if count == 0:
                return

    assert len(asyncio.run(read_three())) == 3
    assert sorted(closed) == [0, 1]
