"""KV cache events: a consumer that sees only the block manager's events rebuilds its prefix cache exactly, and
recomputes each stored block's hash from the token ids as core/kv_events.py documents."""

from __future__ import annotations

import random

import pytest

from pagedserve.backend.core.block_manager import hash_block_tokens
from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    external_hash,
)
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams

PREFIXES = [list(range(1, 13)), [7] * 9, [3, 1, 4, 1, 5, 9, 2, 6]]


class Subscriber:
    """What a router keeps: the set of cached block hashes, from events alone. It also recomputes each stored
    block's digest from token ids where it can (chains without a salt or adapter key) to check the documented rule."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.seen: set[int] = set()
        self.digests: dict[int, bytes] = {}  # hash -> full digest, for chains the consumer can recompute
        self.recomputed = 0

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert event.parent_block_hash is None or event.parent_block_hash in self.seen
                self._recompute(event)
                self.cached.update(event.block_hashes)
                self.seen.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.cached, "removed a block never stored"
                self.cached.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.cached.clear()

    def _recompute(self, event: BlockStored) -> None:
        if event.parent_block_hash is not None and event.parent_block_hash not in self.digests:
            return  # the chain began with a salt or an adapter key
        parent = None if event.parent_block_hash is None else self.digests[event.parent_block_hash]
        bs = event.block_size
        for i, expected in enumerate(event.block_hashes):
            digest = hash_block_tokens(parent, event.token_ids[i * bs : (i + 1) * bs])
            if parent is None and external_hash(digest) != expected:
                assert event.lora_id is not None or i == 0
                return  # a salted or LoRA first block: its key is the engine's
            assert external_hash(digest) == expected
            self.digests[expected] = parent = digest
            self.recomputed += 1


def _workload(runner, rng: random.Random, steps: int, subscriber: Subscriber, lora: bool) -> None:
    bm = runner.scheduler.block_manager
    count = 0
    for step in range(steps):
        if rng.random() < 0.6:
            prompt = rng.choice(PREFIXES) + [rng.randint(1, 49) for _ in range(rng.randint(0, 9))]
            params = SamplingParams(max_tokens=rng.randint(1, 10))
            if lora and rng.random() < 0.3:
                params.lora_name, params.lora_int_id = "ad", 1
            salt = "tenant" if rng.random() < 0.1 else None
            runner.scheduler.add_request(Request(f"r{count}", prompt, params, cache_salt=salt))
            count += 1
        runner.step()
        if step == steps // 2:
            runner.scheduler.reset_prefix_cache()
        subscriber.apply(bm.take_events())
        assert subscriber.cached == {external_hash(h) for h in bm._cached}, f"diverged at step {step}"
    runner.run()
    subscriber.apply(bm.take_events())
    assert subscriber.cached == {external_hash(h) for h in bm._cached}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_subscriber_rebuilds_the_prefix_cache_from_events_through_evictions_preemption_and_reset(
    runner_factory, seed
):
    # 9 blocks of 4 tokens for prompts of up to 21 tokens: blocks are evicted and requests preempted.
    runner = runner_factory(num_blocks=9, block_size=4, max_num_batched_tokens=16, max_model_len=36)
    runner.scheduler.max_loras, runner.scheduler.resident_loras = 1, [1]
    runner.scheduler.block_manager.record_events()
    subscriber = Subscriber()
    _workload(runner, random.Random(seed), 120, subscriber, lora=True)
    assert subscriber.recomputed > 10
    assert runner.scheduler.num_preemptions > 0


def test_events_name_the_lora_adapter_and_chain_parents(runner_factory):
    runner = runner_factory(num_blocks=16, block_size=4)
    runner.scheduler.max_loras, runner.scheduler.resident_loras = 1, [1]
    bm = runner.scheduler.block_manager
    bm.record_events()
    params = SamplingParams(max_tokens=1)
    params.lora_name, params.lora_int_id = "sql", 1
    runner.scheduler.add_request(Request("a", list(range(1, 14)), params))
    runner.run()
    stored = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name, e.block_size, e.medium) for e in stored] == [(1, "sql", 4, "GPU")]
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 3
    assert stored[0].token_ids == list(range(1, 13))


def test_no_events_are_kept_unless_recording(runner_factory):
    runner = runner_factory()
    runner.add("a", list(range(1, 14)), 2)
    runner.run()
    assert runner.scheduler.block_manager.events is None and runner.scheduler.block_manager.take_events() == []


def test_kv_events_config_takes_vllms_fields_and_refuses_others_by_name():
    config = KVEventsConfig.from_dict('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}')
    assert config.publisher == "zmq" and config.publishes and config.buffer_steps == 10_000
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": False}).publisher == "null"
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpont": "tcp://*:1"})
    assert info.value.field == "kv_events_config.endpont"
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict({"publisher": "kafka"})
    assert info.value.field == "kv_events_config.publisher"
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict({"hwm": 0})
    assert info.value.field == "kv_events_config.hwm"
    with pytest.raises(ConfigError) as info:
        KVEventsConfig.from_dict("{not json")
    assert info.value.field == "kv_events_config"
