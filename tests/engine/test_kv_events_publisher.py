"""The KV events publisher on real ZMQ sockets (loopback): vLLM's wire format, sequence numbers, replay for a
late subscriber, and the engine publishing what its prefix cache does."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    external_hash,
    offset_endpoint,
)
from pagedserve.backend.engine.kv_events import ZmqEventPublisher, encode_batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**extra) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{_free_port()}", **extra)


def _subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def test_a_batch_is_positional_and_its_events_are_maps_tagged_by_type():
    events = [BlockStored([11, 12], None, [1, 2, 3, 4], 2, 3, "sql"), BlockRemoved([11]), AllBlocksCleared()]
    assert msgpack.unpackb(encode_batch(events, 1.5, 3)) == [
        1.5,
        [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
          "block_size": 2, "lora_id": 3, "medium": "GPU", "lora_name": "sql"},
         {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
         {"type": "AllBlocksCleared"}],
        3,
    ]
    # Hashes fit a non-negative int64: vllm-router refuses negative ones, Dynamo's relay reads int64.
    big = external_hash(b"\xff" * 16)
    assert msgpack.unpackb(encode_batch([BlockRemoved([big])], 0.0, 0))[1][0]["block_hashes"] == [2**63 - 1]


def test_data_parallel_ranks_offset_the_port_as_vllm_does():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint(None, 1) is None


def test_a_ranked_engine_publishes_on_its_offset_port_as_its_own_servers_rank_0():
    port = _free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port - 1}", topic="kv")
    publisher = ZmqEventPublisher(config, data_parallel_rank=1)
    try:
        assert publisher.endpoint == f"tcp://*:{port}"
        sub = _subscribe(f"tcp://127.0.0.1:{port}", b"kv")
        deadline = time.monotonic() + 5
        while not sub.poll(50):
            assert time.monotonic() < deadline, "no batch reached the subscriber"
            publisher.publish([BlockRemoved([0])])
        _, _, payload = sub.recv_multipart()
        assert msgpack.unpackb(payload)[2] == 0
    finally:
        publisher.shutdown()


def test_subscribers_get_numbered_batches_and_a_late_one_catches_up_by_replay():
    port = _free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{_free_port()}", topic="kv")
    publisher = ZmqEventPublisher(config)
    try:
        sub = _subscribe(f"tcp://127.0.0.1:{port}", b"kv")
        # PUB/SUB drops messages until the subscription has reached the publisher (ZMQ's slow joiner).
        probe = [BlockRemoved([0])]
        deadline = time.monotonic() + 5
        while True:
            publisher.publish(probe)
            if sub.poll(100):
                break
            assert time.monotonic() < deadline, "subscriber never joined"
        topic, seq, payload = sub.recv_multipart()
        first = int.from_bytes(seq, "big")
        assert topic == b"kv" and msgpack.unpackb(payload)[1] == [{"type": "BlockRemoved", "block_hashes": [0],
                                                                    "medium": "GPU"}]
        for i in range(3):
            publisher.publish([BlockStored([100 + i], None, [i, i], 2, None, None)])
        got = [sub.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(s, "big") for _, s, _ in got] == [first + 1, first + 2, first + 3]
        assert [msgpack.unpackb(p)[1][0]["block_hashes"] for _, _, p in got] == [[100], [101], [102]]
        # A subscriber that joins now asks the replay socket for everything from first + 1 on.
        replay = zmq.Context.instance().socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 5000)
        replay.connect(config.replay_endpoint.replace("*", "127.0.0.1"))
        replay.send_multipart((b"", (first + 1).to_bytes(8, "big")))
        answers = []
        while True:
            _, seq, payload = replay.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            answers.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1][0]["block_hashes"]))
        assert answers == [(first + 1, [100]), (first + 2, [101]), (first + 3, [102])]
        replay.close(0)
        sub.close(0)
    finally:
        publisher.shutdown()


def test_an_endpoint_that_cannot_bind_is_refused_naming_the_field():
    holder = zmq.Context.instance().socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError) as info:
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
        assert info.value.field == "kv_events_config.endpoint"
    finally:
        holder.close(0)


@pytest.mark.slow
def test_the_engine_publishes_its_prefix_cache_and_reset(tiny_llama_path):
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    config = _config()
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), dtype="float32", device="cpu", block_size=4,
                                       num_blocks=64, kv_events_config={**_asdict(config)})
    sub = _subscribe(config.endpoint)
    time.sleep(0.3)  # let the subscription reach the publisher before the first batch
    try:
        prompt = list(range(5, 22))  # 17 tokens: 4 full blocks once prefilled
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        engine.reset_prefix_cache()
        batches = []
        while sub.poll(1000):
            batches.append(msgpack.unpackb(sub.recv_multipart()[2]))
        events = [event for batch in batches for event in batch[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored and stored[0]["token_ids"][:16] == prompt[:16] and stored[0]["block_size"] == 4
        assert events[-1] == {"type": "AllBlocksCleared"}
    finally:
        sub.close(0)
        engine.shutdown()


def _asdict(config: KVEventsConfig) -> dict:
    return {"enable_kv_cache_events": True, "endpoint": config.endpoint.replace("127.0.0.1", "*")}


def _check_dynamo_relay_schema(payload: bytes) -> list[dict]:
    """What Dynamo's KvEventPublisher in ZMQ relay mode reads (its docs' "ZMQ Wire Format"): a positional
    [timestamp, [events], dp_rank], each event a dict tagged by type, hashes as int64."""
    int64 = range(-(2**63), 2**63)
    timestamp, events, dp_rank = msgpack.unpackb(payload)
    assert isinstance(timestamp, float) and isinstance(dp_rank, int)
    for event in events:
        if event["type"] == "BlockStored":
            assert all(h in int64 for h in event["block_hashes"]) and event["block_size"] > 0
            assert event["parent_block_hash"] is None or event["parent_block_hash"] in int64
            assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]
            assert event["lora_id"] is None or isinstance(event["lora_id"], int)
        elif event["type"] == "BlockRemoved":
            assert all(h in int64 for h in event["block_hashes"])
        else:
            assert event == {"type": "AllBlocksCleared"}
    return events


def test_a_workloads_event_stream_reads_as_dynamos_zmq_relay_reads_it(tiny_llama_path):
    # ai-dynamo does not install here (a dependency downloads at install time): replay our stream through its
    # documented relay schema instead, from a workload that stores, evicts and clears.
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    config = _config()
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), dtype="float32", device="cpu", block_size=4,
                                       num_blocks=24, kv_events_config=_asdict(config))
    sub = _subscribe(config.endpoint)
    time.sleep(0.3)
    try:
        prompts = [[5 + i] * 3 + list(range(30 + 7 * i, 50 + 7 * i)) for i in range(6)]
        engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
        engine.reset_prefix_cache()
        kinds = []
        while sub.poll(1000):
            kinds += [event["type"] for event in _check_dynamo_relay_schema(sub.recv_multipart()[2])]
        assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    finally:
        sub.close(0)
        engine.shutdown()
