"""KV cache events: what the block manager's prefix cache gained and lost, as vLLM publishes them to routers.

The block manager records a `BlockStored` when full blocks are registered in the prefix cache, a
`BlockRemoved` when a cached block is evicted for reuse, and `AllBlocksCleared` when the prefix cache is
reset; the engine publishes them after each step (engine/kv_events.py). `KVEventsConfig` is vLLM's
`--kv-events-config` with its field names.

Block hashes on the wire are `external_hash` of the engine's own digests: the first 8 bytes of
`block_manager.hash_block_tokens`'s blake2b-128 read big-endian, top bit cleared (a non-negative int64, which
both vllm-router (unsigned) and Dynamo's relay (signed int64) read). That digest has no random seed, so
a block's hash is the same across restarts and replicas: blake2b(digest_size=16) over the parent's 16-byte
digest (16 zero bytes for a first block), the block's token ids as int64 in the machine's byte order (little-endian on x86 and ARM), and for a first block
with a cache salt or a LoRA adapter `b"salt:" + key` (`block_manager.first_block_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedserve.backend.core.errors import ConfigError, json_object

# vLLM's name for the engine's own device-resident KV tier (vllm.distributed.kv_events.MEDIUM_GPU).
MEDIUM = "GPU"
PUBLISHERS = ("null", "zmq")


def external_hash(digest: bytes) -> int:
    """A block digest as the non-negative 63-bit integer events carry (routers key their index by it)."""
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for data-parallel ranks: rank r publishes on the configured port + r (inproc: a suffix)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks registered in the prefix cache: each one's hash, the hash of the block before the
    first (None at a sequence's start), the blocks' token ids, and the adapter whose KV they hold."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    medium: str = MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks evicted (their KV is being overwritten)."""

    block_hashes: list[int]
    medium: str = MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: no earlier hash is cached any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: whether and where the engine publishes its KV cache events."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard host or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("kv_events_config.enable_kv_cache_events must be a bool",
                              "kv_events_config.enable_kv_cache_events")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ConfigError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}",
                              "kv_events_config.publisher")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv_events_config.{name} must be a string", f"kv_events_config.{name}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ConfigError("kv_events_config.replay_endpoint must be a string",
                              "kv_events_config.replay_endpoint")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"kv_events_config.{name} must be a positive int, got {value!r}",
                                  f"kv_events_config.{name}")

    @property
    def publishes(self) -> bool:
        """True when the engine records events and sends them somewhere."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, value: dict | str | None) -> KVEventsConfig:
        """The config from its JSON object (or its text); an unknown key is refused naming it."""
        if value is None:
            return cls()
        value = json_object(value, "kv_events_config", ConfigError)
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise ConfigError(f"kv_events_config has no field {key!r} (known: {sorted(known)})",
                                  f"kv_events_config.{key}")
        return cls(**value)
