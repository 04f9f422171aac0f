"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the shim
(`--reasoning-parser qwen3`), with the official `anthropic` client: text, thinking blocks apart from the
answer, streaming (Anthropic's event sequence, adding up to the whole message), a tool-use round trip,
stop_sequences, count_tokens, x-api-key, and errors in Anthropic's shape naming the field."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-think"
ASK = [{"role": "user", "content": "Is it raining?"}]
THINKING = {"type": "enabled", "budget_tokens": 4}
GREEDY = {"temperature": 0}
WEATHER = {"name": "weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(think_shim_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=think_shim_url, api_key="unused", max_retries=0)


def _create(client, **fields):
    # This SDK no longer names temperature (newer Claude models fix it); the API field still travels in the body.
    return client.messages.create(**{"model": MODEL, "max_tokens": 24, "messages": ASK, "extra_body": GREEDY,
                                     **fields})


def test_text_and_thinking_blocks(client):
    plain = _create(client, system="Be brief.", thinking={"type": "disabled"})
    assert [block.type for block in plain.content] == ["text"] and plain.content[0].text
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.usage.output_tokens > 0
    thought = _create(client, thinking=THINKING)
    assert thought.content[0].type == "thinking" and thought.content[0].thinking
    assert "</think>" not in thought.content[0].thinking


def test_stream_events_add_up_to_the_message(client):
    whole = _create(client, thinking=THINKING)
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY,
                                thinking=THINKING) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert [(b.type, getattr(b, "text", None), getattr(b, "thinking", None)) for b in final.content] == [
        (b.type, getattr(b, "text", None), getattr(b, "thinking", None)) for b in whole.content]
    assert final.stop_reason == whole.stop_reason


def test_tool_use_round_trip(client):
    first = _create(client, max_tokens=80, tools=[WEATHER], thinking=THINKING,
                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    second = _create(client, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert second.content and second.usage.input_tokens > first.usage.input_tokens
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ASK, extra_body=GREEDY, tools=[WEATHER],
                                thinking=THINKING,
                                tool_choice={"type": "tool", "name": "weather"}) as stream:
        final = stream.get_final_message()
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    jsonschema.validate(streamed.input, WEATHER["input_schema"])


def test_stop_sequences_and_count_tokens(client):
    free = _create(client, thinking={"type": "disabled"}).content[0].text
    stop = free[3:6]
    cut = _create(client, thinking={"type": "disabled"}, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[:free.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY, stop_sequences=[stop],
                                thinking={"type": "disabled"}) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == cut.content[0].text
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "disabled"})
    assert counted.input_tokens == _create(client, thinking={"type": "disabled"}).usage.input_tokens


@pytest.mark.parametrize(("fields", "word", "status"), [
    ({"messages": ASK}, "max_tokens", 400),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "tool_use_id", 400),
    ({"max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled"}}, "thinking", 400),
    ({"max_tokens": 8, "messages": ASK, "frobnicate": 1}, "frobnicate", 400),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role", 400),
])
def test_bad_input_in_anthropics_shape(think_shim_url, fields, word, status):
    reply = httpx.post(f"{think_shim_url}/v1/messages", json={"model": MODEL, **fields}, timeout=60)
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert word in body["error"]["message"]


def test_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": -1})


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_bench_streams_each_api(think_shim_url, endpoint):
    """`pagedserve bench --endpoint responses|messages` (what bench/online.py --api runs) times every request."""
    import argparse
    import asyncio

    from pagedserve.client import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--backend", "openai", "--url", f"{think_shim_url}/v1", "--endpoint", endpoint,
                              "--num-prompts", "3", "--input-len", "8", "--output-len", "6", "--max-input-len", "16",
                              "--max-output-len", "12", "--no-progress"])
    summary = asyncio.run(bench.benchmark(args))
    assert summary["completed"] == 3 and summary["ttft_ms"]["p50"] > 0
    items = bench.make_workload(3, 0, 8, 6, 16, 12)  # the same seeded workload: ignore_eos gives each its length
    assert summary["output_tokens"] == sum(item.output_len for item in items) and summary["prompt_tokens"] > 0
