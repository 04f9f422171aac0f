"""Tool calling in the shim without a server: the tool fields checked naming the field, the schema a forced
choice gives the engine, the chat template against transformers (same token ids), and the OpenAI shapes of
calls in whole and streamed answers built from scripted llm responses."""

from __future__ import annotations

import argparse
import asyncio
import json

import jsonschema
import pytest

from pagedserve.client import launcher
from pagedserve.client.launcher import _tool_flags
from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.main import add_arguments, tool_settings
from pagedserve.client.openai.protocol import parse_chat_request
from pagedserve.client.openai.serving_chat import ChatGeneration
from pagedserve.client.openai.shim import OpenAIShim, ShimSettings
from pagedserve.client.openai.tools import AUTO_NEEDS_FLAGS, ToolSettings, check_served, template_tools
from pagedserve.client.triton_client import LLMResponse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
HERMES = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], **fields}


def _param_of(body: dict) -> str | None:
    with pytest.raises(APIError) as info:
        parse_chat_request(body)
    assert info.value.status == 400
    return info.value.param


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "guided_regex": "a+"}, "guided_regex"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                       "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
])
def test_bad_tool_fields_are_refused_naming_them(fields, param):
    assert _param_of(_chat(**fields)) == param


def test_a_reply_message_sent_back_with_its_null_fields_is_taken():
    reply = {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
             "annotations": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "get_time", "arguments": "{}"}}]}
    (_, message) = parse_chat_request(_chat(messages=[{"role": "user", "content": "Time?"}, reply])).messages
    assert message == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}
    assert _param_of(_chat(messages=[{**reply, "refusal": "no"}])) == "messages[0].refusal"


def test_tool_choice_defaults_to_auto_with_tools_and_none_without():
    assert parse_chat_request(_chat(tools=[WEATHER])).tools.choice == "auto"
    assert parse_chat_request(_chat()).tools is None
    assert parse_chat_request(_chat(tool_choice="none")).tools.choice == "none"


def test_auto_is_refused_without_the_flags_as_vllm_refuses_it():
    choice = parse_chat_request(_chat(tools=[WEATHER])).tools
    with pytest.raises(APIError) as info:
        check_served(choice, ToolSettings())
    assert (info.value.param, info.value.message) == ("tool_choice", AUTO_NEEDS_FLAGS)
    check_served(choice, HERMES)
    check_served(parse_chat_request(_chat(tools=[WEATHER], tool_choice="required")).tools, ToolSettings())


def test_required_is_a_list_of_calls_one_unless_parallel():
    request = parse_chat_request(_chat(tools=[WEATHER, CLOCK], tool_choice="required"))
    schema = request.sampling["structured_outputs"]["json"]
    assert request.param_renames["structured_outputs"] == "tools"
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}],
                [{"name": "get_clock", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = parse_chat_request(_chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single.sampling["structured_outputs"]["json"])


def test_named_choice_is_held_to_the_tools_parameters():
    request = parse_chat_request(_chat(tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert request.sampling["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    clock = parse_chat_request(_chat(tools=[WEATHER, CLOCK],
                                     tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert clock.sampling["structured_outputs"] == {"json": {"type": "object", "properties": {}}}


def test_required_moves_the_tools_defs_to_the_root_and_refuses_two_that_differ():
    def tool(name: str, kind: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": kind}}}}}

    schema = parse_chat_request(_chat(tools=[tool("a", "string"), tool("b", "string")], tool_choice="required")
                                ).sampling["structured_outputs"]["json"]
    assert schema["$defs"] == {"X": {"type": "string"}}
    jsonschema.validate([{"name": "a", "parameters": {"x": "hi"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"x": 1}}], schema)
    assert _param_of(_chat(tools=[tool("a", "string"), tool("b", "integer")], tool_choice="required")) == "tools"


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich for 2 days?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Zürich", "days": 2}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
    {"role": "tool", "content": "21 °C, sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": [{"type": "text", "text": "09:30"}], "tool_call_id": "call_2"},
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from pagedserve.testing import build_tokenizer, copy_with_tool_template

    folder = tmp_path_factory.mktemp("tool-tokenizer")
    build_tokenizer().save_pretrained(folder / "plain")
    return copy_with_tool_template(folder / "plain", folder / "tools")


def test_tools_and_tool_history_render_as_transformers_renders_them(tool_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tool_model))
    template = ChatTemplate.from_model_dir(tool_model)
    messages = parse_chat_request(_chat(messages=HISTORY)).messages
    # The shim gives templates a call's arguments as an object, as vLLM does and transformers asks.
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich", "days": 2}
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {}
    for tools in ([WEATHER, CLOCK], None):
        expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        rendered = template.render(messages, tools=tools)
        assert rendered == expected
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == list(getattr(ids, "input_ids", ids))
    assert "<tools>" in template.render(messages, tools=[WEATHER]) and "<tools>" not in template.render(messages)


def test_a_folders_tool_use_template_is_the_one_rendered_with_tools(tmp_path):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "{{ tools | length }} tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render([{"role": "user", "content": "x"}]) == "plain"
    assert template.render([{"role": "user", "content": "x"}], tools=[WEATHER, CLOCK]) == "2 tools"


def test_tool_choice_none_shows_the_tools_unless_the_shim_excludes_them():
    choice = parse_chat_request(_chat(tools=[WEATHER], tool_choice="none")).tools
    assert template_tools(choice, ToolSettings()) == [WEATHER]
    assert template_tools(choice, ToolSettings(exclude_tools_when_tool_choice_none=True)) is None
    assert template_tools(parse_chat_request(_chat(tool_choice="none")).tools, ToolSettings()) is None


def test_flags_as_vllm_takes_them_and_serve_passes_them_on():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert tool_settings(args) == HERMES
    with pytest.raises(SystemExit):
        tool_settings(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])
    serve_parser = argparse.ArgumentParser()
    launcher.add_arguments(serve_parser)  # serve's own flags, whatever else they grow
    serve = serve_parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral",
                                     "--exclude-tools-when-tool-choice-none"])
    assert _tool_flags(serve) == ["--enable-auto-tool-choice", "--tool-call-parser", "mistral",
                                  "--exclude-tools-when-tool-choice-none"]


def _generation(body: dict, tools: ToolSettings = HERMES) -> ChatGeneration:
    request = parse_chat_request(body)
    request.prompts = ["<prompt>"]
    return ChatGeneration(OpenAIShim(ShimSettings(tools=tools)), request)


def _responses(pieces: list[str], finish: str = "stop", n: int = 1):
    async def stream():
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield 0, LLMResponse([piece] * n, [finish if last else None] * n, 5, [i + 1] * n)

    return stream()


OUTPUT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
          '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_whole_answer_has_tool_calls_and_finish_reason_tool_calls():
    body = asyncio.run(_generation(_chat(tools=[WEATHER, CLOCK])).run(_responses([OUTPUT])))
    (choice,) = body["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Checking.\n"
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("function", "get_weather", '{"city": "Zürich", "days": 2}'), ("function", "get_time", "{}")]
    ids = [c["id"] for c in message["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    single = asyncio.run(_generation(_chat(tools=[WEATHER, CLOCK], parallel_tool_calls=False)).run(_responses([OUTPUT])))
    assert [c["function"]["name"] for c in single["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    plain = asyncio.run(_generation(_chat(tools=[WEATHER])).run(_responses(["Just text."])))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Just text.", "refusal": None}
    assert plain["choices"][0]["finish_reason"] == "stop"


def _stream_events(generation: ChatGeneration, pieces: list[str], finish: str = "stop", n: int = 1) -> list[dict]:
    async def collect():
        return [event async for event in generation.chunks(_responses(pieces, finish, n))]

    return [json.loads(e[6:-2]) for e in asyncio.run(collect()) if e != "data: [DONE]\n\n"]


def _assembled(chunks: list[dict], index: int = 0) -> tuple[str, list[dict], list[str]]:
    """What a client builds from the deltas of one choice: content, calls (as OpenAI merges them), finishes."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if call["index"] not in calls:
                    assert set(call) == {"index", "id", "type", "function"} and call["function"]["arguments"] == ""
                    calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return content, list(calls.values()), finishes


@pytest.mark.parametrize("size", [1, 3, 7, len(OUTPUT)])
def test_streamed_calls_add_up_to_the_whole_answer(size):
    body = _chat(tools=[WEATHER, CLOCK], stream=True, n=2)
    whole = asyncio.run(_generation(_chat(tools=[WEATHER, CLOCK], n=2)).run(_responses([OUTPUT], n=2)))
    chunks = _stream_events(_generation(body), [OUTPUT[i:i + size] for i in range(0, len(OUTPUT), size)], n=2)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for index in (0, 1):
        content, calls, finishes = _assembled(chunks, index)
        message = whole["choices"][index]["message"]
        assert content == message["content"] and finishes == ["tool_calls"]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert "<tool_call>" not in "".join(json.dumps(c) for c in chunks)


def test_streamed_text_without_calls_keeps_its_finish_reason_and_logprobs():
    entry = {"token_id": 5, "token": "<", "logprob": -0.5, "top_logprobs": []}

    async def stream():
        yield 0, LLMResponse(["<tool_"], [None], 5, [1], logprobs=[[entry]])
        yield 0, LLMResponse(["x"], ["length"], 5, [2], logprobs=[[entry]])

    generation = _generation(_chat(tools=[WEATHER], stream=True, logprobs=True))

    async def collect():
        return [json.loads(e[6:-2]) async for e in generation.chunks(stream()) if e != "data: [DONE]\n\n"]

    chunks = asyncio.run(collect())
    content, calls, finishes = _assembled(chunks)
    assert (content, calls, finishes) == ("<tool_x", [], ["length"])
    # The held "<tool_" still carried its token's logprobs, on an empty delta.
    assert sum(len((c["choices"][0]["logprobs"] or {}).get("content") or []) for c in chunks) == 2


def test_forced_choices_read_the_constrained_json():
    required = _chat(tools=[WEATHER, CLOCK], tool_choice="required")
    output = '[{"name":"get_weather","parameters":{"city":"Paris","days":1}},{"name":"get_time","parameters":{}}]'
    body = asyncio.run(_generation(required, ToolSettings()).run(_responses([output])))
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris", "days": 1}', "{}"]
    named = _chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    body = asyncio.run(_generation(named, ToolSettings()).run(_responses(['{"city":"Paris","days":3}'])))
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Paris", "days": 3}')
    # Cut by max_tokens after a call, the whole calls stay and the cut one is content; the finish says length.
    cut = asyncio.run(_generation(required, ToolSettings()).run(_responses([output[:-30]], finish="length")))
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["message"]["content"] == output[62:-30]
    assert [c["function"]["name"] for c in cut["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    # Cut off by max_tokens, the JSON is not a call: it comes back as content with finish_reason length.
    cut = asyncio.run(_generation(named, ToolSettings()).run(_responses(['{"city":"Par'], finish="length")))
    assert cut["choices"][0]["message"]["content"] == '{"city":"Par' and cut["choices"][0]["finish_reason"] == "length"


def test_an_echoed_final_message_is_read_with_the_output_whole_and_streamed():
    # The final assistant message is continued and echoed: its text starts the call the model finishes.
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "Sure. <tool_"}]
    body = _chat(messages=messages, tools=[CLOCK], echo=True, continue_final_message=True,
                 add_generation_prompt=False)
    output = 'call>{"name": "get_time", "arguments": {}}</tool_call>'
    whole = asyncio.run(_generation(body).run(_responses([output])))["choices"][0]
    assert whole["message"]["content"] == "Sure. " and whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_time"]
    content, calls, finishes = _assembled(_stream_events(_generation({**body, "stream": True}), list(output)))
    assert (content, [c["name"] for c in calls], finishes) == ("Sure. ", ["get_time"], ["tool_calls"])
