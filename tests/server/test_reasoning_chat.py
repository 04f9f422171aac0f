"""Reasoning on /v1/chat/completions through the shim started with `--reasoning-parser qwen3`, with the
official `openai` client: the thinking in `reasoning` and `reasoning_content`, the answer in `content`,
streamed and not; `include_reasoning: false`; `chat_template_kwargs` reaching the template; and the
constraints (response_format, tool_choice required) holding the answer only, after the thinking budget
forced the end marker (a random model never writes it)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-think"
ASK = [{"role": "user", "content": "Is it raining?"}]
THINK = {"chat_template_kwargs": {"thinking": True}}
SCHEMA = {"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(think_shim_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{think_shim_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def end_ids(think_triton) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(think_triton.model_path / "tokenizer.json")).encode(
        "</think>", add_special_tokens=False).ids


def _chat(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 30, "temperature": 0,
                                             **fields})


def _streamed(chunks) -> tuple[str, str, str, list[str]]:
    reasoning, content, finish, order = "", "", None, []
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning"):
                assert extra["reasoning_content"] == extra["reasoning"]
                reasoning += extra["reasoning"]
                order.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                order.append("content")
            finish = choice.finish_reason or finish
    return reasoning, content, finish, order


def test_thinking_apart_from_the_answer_whole_and_streamed(client, end_ids):
    reply = _chat(client, extra_body={**THINK, "thinking_token_budget": 5})
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert reasoning and message.model_extra["reasoning_content"] == reasoning
    assert "</think>" not in reasoning and "</think>" not in message.content
    # The budget forced the marker after 5 thought tokens; each llm response brought one token.
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5 + len(end_ids)
    chunks = list(_chat(client, stream=True, extra_body={**THINK, "thinking_token_budget": 5}))
    streamed_reasoning, content, finish, order = _streamed(chunks)
    assert (streamed_reasoning, content, finish) == (reasoning, message.content, reply.choices[0].finish_reason)
    assert order == sorted(order, key=lambda kind: kind == "content")  # all the reasoning, then the answer


def test_without_a_budget_the_whole_output_is_thinking(client):
    message = _chat(client, extra_body=THINK).choices[0].message
    assert message.model_extra["reasoning"] and message.content == ""


def test_enable_thinking_false_reaches_the_template(client):
    message = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.model_extra["reasoning"] is None and message.content


def test_include_reasoning_false_drops_it(client):
    fields = {**THINK, "thinking_token_budget": 3, "include_reasoning": False}
    whole = _chat(client, extra_body=fields).choices[0].message
    assert "reasoning" not in whole.model_extra and "reasoning_content" not in whole.model_extra
    reasoning, content, _, _ = _streamed(_chat(client, stream=True, extra_body=fields))
    assert reasoning == "" and content == whole.content


def test_response_format_holds_the_answer_only(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "rain", "schema": SCHEMA}}
    reply = _chat(client, max_tokens=60, response_format=fmt, extra_body={**THINK, "thinking_token_budget": 4})
    message = reply.choices[0].message
    assert message.model_extra["reasoning"]
    jsonschema.validate(json.loads(message.content), SCHEMA)
    reasoning, content, _, _ = _streamed(_chat(client, max_tokens=60, response_format=fmt, stream=True,
                                               extra_body={**THINK, "thinking_token_budget": 4}))
    assert (reasoning, content) == (message.model_extra["reasoning"], message.content)


def test_tool_choice_required_calls_after_the_thinking(client):
    reply = _chat(client, max_tokens=80, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  extra_body={**THINK, "thinking_token_budget": 4})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning"]
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_budget_without_thinking_parser_fields_are_checked(client):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body={"thinking_token_budget": -1})
    assert info.value.body["param"] == "thinking_token_budget"
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body={"include_reasoning": "no"})
    assert info.value.body["param"] == "include_reasoning"
