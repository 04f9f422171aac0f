"""Tool calling end to end: the official `openai` client (sync, async, streaming) through the shim, started
with `--enable-auto-tool-choice --tool-call-parser hermes`, and a real tritonserver serving a tiny Llama
whose chat template renders tools (pagedserve.testing.TOOL_CHAT_TEMPLATE), for every tool_choice, and a
two-turn conversation that sends the tool's result back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from pagedserve.client.openai.tool_parsers import TOOL_PARSERS
from pagedserve.testing import copy_with_tool_template
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

MODEL = "tiny-tools"
# The tools' JSON sits in the prompt: a context longer than the session server's 256.
ENGINE_PARAMS = {**CPU_FP32, "max_model_len": "1024", "num_blocks": "256", "max_num_seqs": "16",
                 "max_num_batched_tokens": "1024"}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def tool_triton(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver (llm only) serving a copy of the tiny Llama that has the tool template."""
    work_dir = tmp_path_factory.mktemp("tool-triton")
    model = copy_with_tool_template(tiny_llama_path, work_dir / MODEL)
    with triton_running(model, work_dir, ENGINE_PARAMS, llm_only=True) as running:
        yield running


@pytest.fixture(scope="module")
def shim_url(tool_triton) -> Iterator[str]:
    with tool_triton.openai_shim("--model-name", MODEL, "--enable-auto-tool-choice",
                                 "--tool-call-parser", "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def client(shim_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tool_triton):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_triton.model_path))


def _prompt_tokens(tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(getattr(ids, "input_ids", ids))


def _check_calls(message, names: set[str]) -> None:
    """Each call names one of `names` and its arguments validate against that tool's parameters."""
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(chunks: list) -> tuple[str, list[tuple[str, str]], str]:
    """Content, calls (name, arguments) and finish reason assembled from a chat stream, as a client does."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def _chat(client, **fields):
    return client.chat.completions.create(**{"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **fields})


def test_none_renders_the_tools_and_answers_in_text(client, tokenizer):
    reply = _chat(client, messages=ASK, tools=TOOLS, tool_choice="none")
    (choice,) = reply.choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    # As vLLM (without --exclude-tools-when-tool-choice-none): the template still shows the tools.
    assert reply.usage.prompt_tokens == _prompt_tokens(tokenizer, ASK, TOOLS)
    assert _chat(client, messages=ASK).usage.prompt_tokens == _prompt_tokens(tokenizer, ASK, None)


def test_auto_answers_well_formed_whatever_the_model_writes(client):
    reply = _chat(client, messages=ASK, tools=TOOLS)  # auto is the default with tools
    (choice,) = reply.choices
    content, calls = TOOL_PARSERS["hermes"]().parse(_raw_text(client))
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (c.name, c.arguments) for c in calls]
    else:
        assert choice.finish_reason in ("stop", "length") and not calls
    assert choice.message.content == content
    chunks = list(_chat(client, messages=ASK, tools=TOOLS, stream=True))
    streamed_content, streamed_calls, finish = _streamed(chunks)
    assert finish == choice.finish_reason and streamed_content == (choice.message.content or "")
    assert streamed_calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def _raw_text(client) -> str:
    """What the model writes for ASK with TOOLS rendered, without tool parsing (tool_choice none)."""
    return _chat(client, messages=ASK, tools=TOOLS, tool_choice="none").choices[0].message.content


def test_auto_parses_a_call_the_model_was_made_to_write(client):
    # A random model rarely writes a call by itself: make it write one through a regex constraint,
    # which the hermes parser then reads out of the text.
    call = '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
    reply = _chat(client, messages=ASK, tools=TOOLS, extra_body={"guided_regex": "Sure\\. " + _regex_literal(call)})
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("clock", "{}")]
    chunks = list(_chat(client, messages=ASK, tools=TOOLS, stream=True,
                        extra_body={"guided_regex": "Sure\\. " + _regex_literal(call)}))
    assert _streamed(chunks) == ("Sure. ", [("clock", "{}")], "tool_calls")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in "\\.^$|?*+()[]{}" else ("\\n" if ch == "\n" else ch) for ch in text)


def test_required_gives_calls_that_validate_sync_async_and_streamed(client, shim_url):
    fields = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    reply = _chat(client, **fields)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message, {"weather", "clock"})
    assert len(choice.message.tool_calls) == 1
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    async def both():
        async_client = openai.AsyncOpenAI(base_url=f"{shim_url}/v1", api_key="unused", max_retries=0)
        reply = await async_client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, **fields)
        stream = await async_client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                                                            stream=True, **fields)
        return reply, [chunk async for chunk in stream]

    async_reply, chunks = asyncio.run(both())
    assert [(c.function.name, c.function.arguments) for c in async_reply.choices[0].message.tool_calls] == whole
    assert _streamed(chunks) == ("", whole, "tool_calls")


def test_required_with_parallel_calls_and_sampling(client):
    reply = _chat(client, messages=ASK, tools=TOOLS, tool_choice="required", n=3, seed=7, temperature=1.0)
    for choice in reply.choices:
        if choice.message.tool_calls:
            _check_calls(choice.message, {"weather", "clock"})
        else:  # the sampled list ran past max_tokens before a call closed: it comes back as content
            assert choice.message.content.startswith("[")
        # A list max_tokens cut short keeps its whole calls; the cut one is content, the finish "length".
        assert choice.finish_reason == ("length" if choice.message.content else "tool_calls")
    assert any(choice.message.tool_calls for choice in reply.choices)


def test_named_choice_calls_that_function(client):
    choice_field = {"type": "function", "function": {"name": "weather"}}
    reply = _chat(client, messages=ASK, tools=TOOLS, tool_choice=choice_field)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message, {"weather"})
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(whole) == 1
    assert _streamed(list(_chat(client, messages=ASK, tools=TOOLS, tool_choice=choice_field, stream=True))) == (
        "", whole, "tool_calls")


def test_the_tool_result_goes_back_and_the_model_answers(client, tokenizer):
    first = _chat(client, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    call = first.choices[0].message.tool_calls[0]
    # The reply's message goes back as the SDK sends it (with its null refusal, audio, function_call).
    messages = [*ASK, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    reply = _chat(client, messages=messages, tools=TOOLS, tool_choice="none")
    (choice,) = reply.choices
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    # The shim rendered the call and its result as transformers does, given the arguments as an object.
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "weather", "arguments": json.loads(call.function.arguments)}}]}, messages[2]]
    assert reply.usage.prompt_tokens == _prompt_tokens(tokenizer, history, TOOLS)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": {"weather": WEATHER}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400_naming_the_field(shim_url, fields, param):
    body = {"model": MODEL, "messages": ASK, **fields}
    reply = httpx.post(f"{shim_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_auto_needs_the_flags(tool_triton):
    with tool_triton.openai_shim("--model-name", MODEL) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, messages=ASK, tools=TOOLS)
        assert info.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in info.value.body["message"]
        assert _chat(client, messages=ASK, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls


def test_tokenize_renders_the_tools_as_chat_does(client, shim_url, tokenizer):
    import httpx

    answer = httpx.post(f"{shim_url}/tokenize", json={"model": MODEL, "messages": ASK, "tools": TOOLS}).json()
    assert answer["count"] == _prompt_tokens(tokenizer, ASK, TOOLS) > _prompt_tokens(tokenizer, ASK, None)
