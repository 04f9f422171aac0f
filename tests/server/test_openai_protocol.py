"""The OpenAI shim's pure parts: request translation, chat templates, SSE framing (no server needed)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pagedserve.client.openai_server import (
    SSE_DONE,
    APIError,
    ChatTemplate,
    Generation,
    GenerationRequest,
    OpenAIShim,
    ShimSettings,
    parse_chat_request,
    parse_completion_request,
    sse_event,
)
from pagedserve.client.triton_client import LLMResponse


def _completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}


def _param_of(parse, body: dict) -> str | None:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    return info.value.param


def test_completion_defaults_to_openai_max_tokens_of_16():
    request = parse_completion_request(_completion())
    assert request.prompts == ["Hello"]
    assert request.sampling == {"max_tokens": 16}
    assert not request.stream and request.logprobs is None


def test_completion_sampling_fields_become_sampling_parameters():
    request = parse_completion_request(
        _completion(temperature=0, top_p=0.5, n=2, stop="\n", seed=7, max_tokens=5, logprobs=3,
                    presence_penalty=0.5, frequency_penalty=-0.5, stream=True,
                    stream_options={"include_usage": True})
    )
    assert request.sampling == {
        "temperature": 0, "top_p": 0.5, "n": 2, "stop": ["\n"], "seed": 7, "max_tokens": 5, "logprobs": 3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5,
    }
    assert request.stream and request.include_usage and request.logprobs == 3 and request.n == 2


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_accepts_every_openai_prompt_form(prompt, expected):
    assert parse_completion_request(_completion(prompt=prompt)).prompts == expected


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], 5, {"text": "a"}, [True]])
def test_completion_refuses_malformed_prompt_naming_it(prompt):
    assert _param_of(parse_completion_request, _completion(prompt=prompt)) == "prompt"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        # JSON allows a lone surrogate ("\ud800"), which cannot be sent on as UTF-8.
        ({"prompt": "hi \ud800"}, "prompt"),
        ({"prompt": ["ok", "\udfff"]}, "prompt"),
        ({"stop": ["\ud800"]}, "stop"),
        # Token ids travel as INT32: a negative or larger id is refused, never wrapped to another token.
        ({"prompt": [5, -3]}, "prompt"),
        ({"prompt": [[5], [2**32 + 5]]}, "prompt"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"suffix": "end"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous": True}}, "stream_options"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"model": 3}, "model"),
    ],
)
def test_completion_bad_fields_are_named(fields, param):
    assert _param_of(parse_completion_request, _completion(**fields)) == param


def test_completion_without_model_or_prompt_names_the_missing_field():
    assert _param_of(parse_completion_request, {"prompt": "x"}) == "model"
    assert _param_of(parse_completion_request, {"model": "m"}) == "prompt"


def test_chat_max_completion_tokens_sets_the_limit_and_default_is_unbounded():
    assert parse_chat_request(_chat()).sampling == {"max_tokens": None}
    assert parse_chat_request(_chat(max_completion_tokens=7)).sampling == {"max_tokens": 7}
    assert parse_chat_request(_chat(max_tokens=9)).sampling == {"max_tokens": 9}


def test_chat_logprobs_and_top_logprobs_map_to_engine_logprobs():
    assert parse_chat_request(_chat(logprobs=True)).sampling["logprobs"] == 0
    request = parse_chat_request(_chat(logprobs=True, top_logprobs=4))
    assert request.sampling["logprobs"] == 4 and request.logprobs == 4
    assert "logprobs" not in parse_chat_request(_chat(logprobs=False)).sampling


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a \ud800"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a", "name": 7}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
        ({"echo": True}, "echo"),
    ],
)
def test_chat_bad_fields_are_named(fields, param):
    assert _param_of(parse_chat_request, _chat(**fields)) == param


def test_chat_messages_flatten_text_parts_and_map_developer_to_system():
    request = parse_chat_request(
        _chat(messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ])
    )
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]


def test_chat_template_renders_like_transformers(tmp_path):
    from pagedserve.testing import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 🙂"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_model_dir(tmp_path).render(messages) == expected


def test_chat_template_from_tokenizer_config_json(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "hi"}])
    assert rendered == "<s>[user]hi</s>"


def test_chat_template_is_sandboxed_and_errors_name_messages():
    mutating = ChatTemplate("{{ messages.append({'role': 'x'}) }}")
    with pytest.raises(APIError) as info:
        mutating.render([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"
    raising = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(APIError, match="only user turns"):
        raising.render([{"role": "user", "content": "hi"}])


def test_model_folder_without_template_is_reported(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        ChatTemplate.from_model_dir(tmp_path)


def test_sse_event_is_one_data_line_and_a_blank_line():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


# ---- Generation: llm responses into OpenAI bodies, with a scripted response stream


def _responses(*items: tuple[int, LLMResponse]):
    async def stream():
        for item in items:
            yield item

    return stream()


def _generation(request: GenerationRequest, chat: bool) -> Generation:
    return Generation(OpenAIShim(ShimSettings()), request, chat)


def _events(generation: Generation, stream) -> list[dict | str]:
    async def collect():
        return [event async for event in generation.chunks(stream)]

    events = asyncio.run(collect())
    assert all(e.startswith("data: ") and e.endswith("\n\n") and "\n" not in e[:-2] for e in events)
    return [e[6:-2] if e == SSE_DONE else json.loads(e[6:-2]) for e in events]


def test_streamed_completion_chunks_carry_deltas_then_usage_then_done():
    request = parse_completion_request(
        _completion(n=2, stream=True, stream_options={"include_usage": True})
    )
    stream = _responses(
        (0, LLMResponse(["He", "Wo"], [None, None], 3, [1, 1])),
        (0, LLMResponse(["llo", ""], [None, "length"], 3, [2, 1])),
        # As the llm model does: an ended completion keeps its finish reason in later responses.
        (0, LLMResponse(["", ""], ["stop", "length"], 3, [2, 1])),
    )
    events = _events(_generation(request, chat=False), stream)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    text = {0: "", 1: ""}
    finish = []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finish.append((choice["index"], choice["finish_reason"]))
    # Each choice ends exactly once.
    assert text == {0: "Hello", 1: "Wo"} and sorted(finish) == [(0, "stop"), (1, "length")]


def test_streamed_chat_starts_with_role_and_ends_with_empty_delta_finish():
    request = parse_chat_request(_chat(stream=True))
    request.prompts = ["<prompt>"]
    stream = _responses((0, LLMResponse(["Hi"], [None], 2, [1])), (0, LLMResponse([" you"], ["stop"], 2, [2])))
    events = _events(_generation(request, chat=True), stream)
    assert events[-1] == "[DONE]"
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events[:-1]]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hi"}, None),
        ({"content": " you"}, None),
        ({}, "stop"),
    ]
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events[:-1])


def test_non_streamed_completion_echoes_prompt_and_sums_usage_over_prompts():
    request = parse_completion_request(_completion(prompt=["A", "B"], echo=True))
    stream = _responses(
        (1, LLMResponse([" b!"], ["length"], 1, [2])),
        (0, LLMResponse([" a"], ["stop"], 1, [1])),
    )
    body = asyncio.run(_generation(request, chat=False).run(stream))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A a", "stop"), (1, "B b!", "length"),
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"


def test_chat_logprobs_have_openai_shape():
    request = parse_chat_request(_chat(logprobs=True, top_logprobs=1))
    request.prompts = ["p"]
    entry = {"token_id": 5, "token": "é", "logprob": -0.5,
             "top_logprobs": [{"token_id": 5, "token": "é", "logprob": -0.5}, {"token_id": 6, "token": "a", "logprob": -1.0}]}
    stream = _responses((0, LLMResponse(["é"], ["length"], 1, [1], logprobs=[[entry]])))
    body = asyncio.run(_generation(request, chat=True).run(stream))
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "é", "refusal": None}
    assert choice["logprobs"]["content"] == [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]}]}
    ]


def test_completion_logprobs_have_legacy_shape_with_text_offsets():
    request = parse_completion_request(_completion(logprobs=1))
    entries = [{"token_id": 1, "token": "ab", "logprob": -0.1, "top_logprobs": [{"token_id": 1, "token": "ab", "logprob": -0.1}]},
               {"token_id": 2, "token": "c", "logprob": -0.2, "top_logprobs": [{"token_id": 2, "token": "c", "logprob": -0.2}]}]
    stream = _responses((0, LLMResponse(["abc"], ["length"], 1, [2], logprobs=[entries])))
    body = asyncio.run(_generation(request, chat=False).run(stream))
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["ab", "c"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"ab": -0.1}, {"c": -0.2}], "text_offset": [0, 2],
    }


def test_chat_prompts_get_no_special_tokens_added_unless_asked():
    assert parse_chat_request(_chat()).add_special_tokens is False
    assert parse_chat_request(_chat(add_special_tokens=True)).add_special_tokens is True
    assert parse_completion_request(_completion()).add_special_tokens is True
    assert _param_of(parse_chat_request, _chat(add_special_tokens="no")) == "add_special_tokens"

    sent = []

    class RecordingClient:
        def generate(self, prompt, **kwargs):
            sent.append((prompt, kwargs["add_special_tokens"]))

    shim = OpenAIShim(ShimSettings())
    shim._client = RecordingClient()
    request = parse_chat_request(_chat())
    request.prompts = ["<bos>rendered"]
    shim.triton_streams(request, "id")
    assert sent == [("<bos>rendered", False)]


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert parse_completion_request(_completion(echo=True, logprobs=2)).sampling["prompt_logprobs"] == 2
    assert "prompt_logprobs" not in parse_completion_request(_completion(logprobs=2)).sampling
    assert "prompt_logprobs" not in parse_completion_request(_completion(echo=True)).sampling


_PROMPT_ENTRIES = [
    {"token_id": 1, "token": "Hel", "logprob": None, "top_logprobs": None},
    {"token_id": 2, "token": "lo", "logprob": -1.5, "top_logprobs": [{"token_id": 3, "token": "p", "logprob": -1.0},
                                                                      {"token_id": 2, "token": "lo", "logprob": -1.5}]},
]
_GENERATED_ENTRY = {"token_id": 4, "token": " a", "logprob": -0.1,
                    "top_logprobs": [{"token_id": 4, "token": " a", "logprob": -0.1}]}


def test_echo_with_logprobs_scores_the_prompt_tokens_first():
    request = parse_completion_request(_completion(echo=True, logprobs=1))
    stream = _responses((0, LLMResponse([" a"], ["length"], 2, [1], logprobs=[[_GENERATED_ENTRY]],
                                        prompt_logprobs=_PROMPT_ENTRIES)))
    (choice,) = asyncio.run(_generation(request, chat=False).run(stream))["choices"]
    assert choice["text"] == "Hello a"
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo", " a"], "token_logprobs": [None, -1.5, -0.1],
        "top_logprobs": [None, {"p": -1.0}, {" a": -0.1}], "text_offset": [0, 3, 5],
    }


def test_streamed_echo_with_logprobs_sends_the_prompt_with_its_logprobs_first():
    request = parse_completion_request(_completion(echo=True, logprobs=1, stream=True))
    stream = _responses(
        (0, LLMResponse([" a"], [None], 2, [1], logprobs=[[_GENERATED_ENTRY]], prompt_logprobs=_PROMPT_ENTRIES)),
        (0, LLMResponse([""], ["length"], 2, [1], logprobs=[[]])),
    )
    events = _events(_generation(request, chat=False), stream)
    texts = [(e["choices"][0]["text"], e["choices"][0]["logprobs"]) for e in events[:-1]]
    assert texts[0] == ("Hello", {"tokens": ["Hel", "lo"], "token_logprobs": [None, -1.5],
                                  "top_logprobs": [None, {"p": -1.0}], "text_offset": [0, 3]})
    assert texts[1] == (" a", {"tokens": [" a"], "token_logprobs": [-0.1], "top_logprobs": [{" a": -0.1}],
                               "text_offset": [5]})
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only():
    request = parse_completion_request(_completion(echo=True, logprobs=1, max_tokens=0))
    assert request.echo_only and request.sampling["max_tokens"] == 1
    answer = LLMResponse([" a"], ["stop"], 2, [1], logprobs=[[_GENERATED_ENTRY]], prompt_logprobs=_PROMPT_ENTRIES)
    body = asyncio.run(_generation(request, chat=False).run(_responses((0, answer))))
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "length")
    assert choice["logprobs"]["tokens"] == ["Hel", "lo"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}

    streamed = parse_completion_request(_completion(echo=True, logprobs=1, max_tokens=0, stream=True))
    events = _events(_generation(streamed, chat=False), _responses((0, answer)))
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        ("Hello", None), ("", "length")]


def test_non_streamed_work_is_cancelled_when_the_client_disconnects():
    from pagedserve.client.openai_server import ClientGone, _unless_disconnected

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
        asyncio.run(_unless_disconnected(GoneAfterTwoPolls(), endless_generation()))
    assert cancelled == [True]


def test_merged_streams_close_every_source_when_the_reader_stops():
    from pagedserve.client.openai_server import merge_streams

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


@pytest.mark.parametrize(
    "error, status, param",
    [
        ("server busy: 4096 requests already waiting", 503, None),
        ("the llm model is shutting down", 503, None),
        ("prompt of 300 tokens plus max_tokens 16 exceeds max_model_len 256", 400, "prompt"),
        ("top_p must be in (0, 1], got 1.5", 400, "top_p"),
        # A server fault (the llm model's INTERNAL errors start so) is a 500, never the client's fault.
        ("internal error: engine step failed: RuntimeError('boom')", 500, None),
    ],
)
def test_llm_errors_map_to_openai_status_and_param(error, status, param):
    from pagedserve.client.openai_server import _triton_error
    from pagedserve.client.triton_client import TritonRequestError

    api_error = _triton_error(TritonRequestError(error))
    assert (api_error.status, api_error.param) == (status, param)
    assert api_error.body()["error"]["message"] == error


def test_unreachable_triton_is_503():
    from pagedserve.client.openai_server import _triton_error
    from pagedserve.client.triton_client import TritonUnavailableError

    api_error = _triton_error(TritonUnavailableError("tritonserver at 127.0.0.1:9: connection refused"))
    assert api_error.status == 503 and api_error.body()["error"]["type"] == "server_error"
