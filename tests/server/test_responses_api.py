"""The Responses API (/v1/responses) through the shim (`--reasoning-parser qwen3`), with the official `openai`
client: create (string and item input, instructions, reasoning apart from the answer, usage with reasoning
tokens), stream (the SDK's events in order, adding up to the whole response), parse with a pydantic model
(text.format json_schema after the thinking), a function-call round trip, a conversation continued from a
stored response, GET / DELETE / cancel, and the refusals in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-think"
THINK = {"chat_template_kwargs": {"thinking": True}, "thinking_token_budget": 4}
WEATHER = {"type": "function", "name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
    "additionalProperties": False}}


class Rain(pydantic.BaseModel):
    rain: bool


@pytest.fixture(scope="module")
def client(think_shim_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{think_shim_url}/v1", api_key="unused", max_retries=0)


def _create(client, **fields):
    return client.responses.create(**{"model": MODEL, "max_output_tokens": 24, "temperature": 0, **fields})


def test_create_splits_reasoning_from_the_answer(client):
    response = _create(client, input="Is it raining?", instructions="Be brief.", extra_body=THINK)
    assert response.status == "completed" or response.status == "incomplete"
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and "message" in kinds
    reasoning = response.output[0].content[0].text
    assert reasoning and "</think>" not in reasoning and "</think>" not in response.output_text
    assert response.usage.output_tokens_details.reasoning_tokens > 4
    assert response.usage.output_tokens == 24 or response.status == "completed"
    items = _create(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "Is it raining?"}]}],
                    instructions="Be brief.", extra_body=THINK)
    assert items.output_text == response.output_text  # the same prompt, greedy


def test_an_incomplete_stream_ends_with_response_incomplete(client):
    with client.responses.stream(model=MODEL, input="Is it raining?", max_output_tokens=8, temperature=0) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds


def test_stream_events_in_order_add_up_to_the_response(client):
    # A JSON answer ends (a random model's free text runs to max_output_tokens: response.incomplete).
    fmt = {"format": {"type": "json_schema", "name": "rain", "schema": Rain.model_json_schema()}}
    whole = _create(client, input="Is it raining?", text=fmt, max_output_tokens=60, extra_body=THINK)
    assert whole.status == "completed"
    with client.responses.stream(model=MODEL, input="Is it raining?", max_output_tokens=60, temperature=0,
                                 text=fmt, extra_body=THINK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == whole.output[0].content[0].text and text == whole.output_text
    assert final.output_text == whole.output_text
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(added)))


def test_parse_with_pydantic_after_the_thinking(client):
    parsed = client.responses.parse(model=MODEL, input="Is it raining?", text_format=Rain, max_output_tokens=60,
                                    temperature=0, extra_body=THINK)
    assert isinstance(parsed.output_parsed, Rain)
    assert parsed.output[0].type == "reasoning"


def test_function_call_round_trip_and_continued_conversation(client):
    first = _create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=80, extra_body=THINK)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments)["city"] in ("Paris", "Lyon")
    second = _create(client, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.previous_response_id == first.id and second.output
    # The continuation rendered the whole history: more prompt tokens than the first turn's.
    assert second.usage.input_tokens > first.usage.input_tokens
    third = _create(client, previous_response_id=second.id, input="And tomorrow?", tools=[WEATHER],
                    tool_choice="none")
    assert third.usage.input_tokens > second.usage.input_tokens


def test_get_delete_and_cancel(client, think_shim_url):
    response = _create(client, input="hello")
    assert client.responses.retrieve(response.id).id == response.id
    reply = httpx.post(f"{think_shim_url}/v1/responses/{response.id}/cancel")
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = _create(client, input="hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("fields", "param", "status"), [
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id", 404),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type", 400),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id", 400),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", 400),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", 400),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", 400),
    ({"input": "x", "frobnicate": 1}, "frobnicate", 400),
    ({"input": 3}, "input", 400),
])
def test_bad_input_is_refused_naming_the_field(think_shim_url, fields, param, status):
    reply = httpx.post(f"{think_shim_url}/v1/responses", json={"model": MODEL, **fields}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]


def test_cancel_stops_a_streamed_response(think_shim_url):
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{think_shim_url}/v1/responses", json=body) as reply:
        lines = (line for line in reply.iter_lines() if line.startswith("data: "))
        created = json.loads(next(lines)[len("data: "):])
        response_id = created["response"]["id"]
        cancelled = http.post(f"{think_shim_url}/v1/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        events = [json.loads(line[len("data: "):]) for line in lines]
    last = events[-1]["response"]
    assert last["status"] == "cancelled" and last["usage"]["output_tokens"] < 400
    assert http_get(think_shim_url, response_id)["status"] == "cancelled"


def http_get(url: str, response_id: str) -> dict:
    return httpx.get(f"{url}/v1/responses/{response_id}", timeout=30).json()
