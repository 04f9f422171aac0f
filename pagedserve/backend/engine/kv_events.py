"""Publishes the block manager's KV cache events over ZMQ in vLLM's wire format, off the step's thread.

Each step's events form one batch, msgpack-encoded as vLLM's msgspec structs are: the batch a positional
array, each event a map tagged with its class name under "type" (what vllm-router's kv_index decodes, and
Dynamo's ZMQ relay and llm-d's indexer with it):
  batch            [ts, [event, ...], data_parallel_rank]
  BlockStored      {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name"}
  BlockRemoved     {"type": "BlockRemoved", "block_hashes", "medium"}
  AllBlocksCleared {"type": "AllBlocksCleared"}
and is sent as the multipart message (topic, sequence number as 8 bytes big-endian, payload). A subscriber
that missed batches sends the first sequence number it lacks (8 bytes big-endian) to the replay ROUTER socket
and gets (sequence, payload) for each buffered batch from there on, then (-1, b"").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventsConfig,
    offset_endpoint,
)

logger = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent) -> dict:
    """One event as vLLM's map tagged with its class name."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
                "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
                "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], timestamp: float, data_parallel_rank: int) -> bytes:
    """A step's events as one msgpack EventBatch."""
    import msgpack

    return msgpack.packb([timestamp, [encode_event(e) for e in events], data_parallel_rank], use_bin_type=True)


class ZmqEventPublisher:
    """A PUB socket (and an optional replay ROUTER socket) served by one daemon thread; publish() only queues."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._config = config
        # Every pagedserve engine is a server of its own, so its batches carry rank 0 (the rank within that server,
        # as a separate vLLM server's do: vllm-router reads each static source as rank 0 and drops other ranks'
        # batches); data_parallel_rank still offsets the ports and labels the metrics.
        self._rank = 0
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._context = zmq.Context.instance()
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as reason:
            self._close_sockets()
            raise ConfigError(f"kv_events_config: cannot open {self.endpoint!r} / {self.replay_endpoint!r}: "
                              f"{reason}", "kv_events_config.endpoint") from None
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events; when the queue is full the batch is dropped (a router then replays)."""
        if events:
            try:
                self._queue.put_nowait((time.time(), events))
            except queue.Full:
                logger.warning("KV events queue full; a batch of %d events was dropped", len(events))

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _serve(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            payload = encode_batch(item[1], item[0], self._rank)
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._config.topic.encode(), seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [identity, empty delimiter, start sequence]
            logger.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)


def _binds(endpoint: str) -> bool:
    """vLLM's convention: bind a wildcard host or an ipc/inproc address, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher the config asks for; None when events are off."""
    return ZmqEventPublisher(config, data_parallel_rank) if config.publishes else None
