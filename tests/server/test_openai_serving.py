"""llm responses into OpenAI bodies and SSE chunks, for completions and chat, with scripted response
streams (no server needed)."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from pagedserve.client.openai.formats import SSE_DONE, sse_event
from pagedserve.client.openai.generation import Generation
from pagedserve.client.openai.protocol import parse_completion_request
from pagedserve.client.openai.serving_chat import ChatGeneration
from pagedserve.client.openai.serving_completion import CompletionGeneration
from pagedserve.client.openai.shim import OpenAIShim, ShimSettings
from pagedserve.client.triton_client import LLMResponse
from pagedserve.testing import build_tokenizer, copy_with_bos_tokenizer, copy_with_tool_template


def _completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_sse_event_is_one_data_line_and_a_blank_line():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def _responses(*items: tuple[int, LLMResponse]):
    async def stream():
        for item in items:
            yield item

    return stream()


def _completion_generation(request) -> CompletionGeneration:
    return CompletionGeneration(OpenAIShim(ShimSettings()), request)


@pytest.fixture(scope="module")
def chat_folders(tmp_path_factory) -> dict[str, str]:
    """Tokenizer folders: one whose template starts with a BOS the tokenizer also adds (as Llama's does),
    one with the Hermes-style tool template."""
    plain = tmp_path_factory.mktemp("plain")
    build_tokenizer().save_pretrained(plain)
    root = tmp_path_factory.mktemp("chat")
    return {"bos": str(copy_with_bos_tokenizer(plain, root / "bos")),
            "tools": str(copy_with_tool_template(plain, root / "tools"))}


def _chat_generation(folder: str, body: dict) -> ChatGeneration:
    """A chat answer as the shim makes one: its messages rendered with `folder`'s template."""
    return asyncio.run(ChatGeneration.create(OpenAIShim(ShimSettings(model_name="m", model_path=folder)), body))


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
    events = _events(_completion_generation(request), stream)
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


def test_streamed_chat_starts_with_role_and_ends_with_empty_delta_finish(chat_folders):
    generation = _chat_generation(chat_folders["bos"], _chat(stream=True))
    stream = _responses((0, LLMResponse(["Hi"], [None], 2, [1])), (0, LLMResponse([" you"], ["stop"], 2, [2])))
    events = _events(generation, stream)
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
    body = asyncio.run(_completion_generation(request).run(stream))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A a", "stop"), (1, "B b!", "length"),
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"


def test_chat_logprobs_have_openai_shape(chat_folders):
    generation = _chat_generation(chat_folders["bos"], _chat(logprobs=True, top_logprobs=1))
    entry = {"token_id": 5, "token": "é", "logprob": -0.5,
             "top_logprobs": [{"token_id": 5, "token": "é", "logprob": -0.5}, {"token_id": 6, "token": "a", "logprob": -1.0}]}
    stream = _responses((0, LLMResponse(["é"], ["length"], 1, [1], logprobs=[[entry]])))
    body = asyncio.run(generation.run(stream))
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
    body = asyncio.run(_completion_generation(request).run(stream))
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["ab", "c"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"ab": -0.1}, {"c": -0.2}], "text_offset": [0, 2],
    }


_CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How are you?"},
    {"role": "user", "content": "Fine, and you? Café ✓"},
]
_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(("folder", "extra"), [("bos", {}), ("tools", {"tools": [_WEATHER_TOOL], "tool_choice": "required"})],
                         ids=["bos-template", "tool-template"])
def test_the_llm_gets_the_tokenizers_own_rendered_chat_without_special_tokens(chat_folders, folder, extra):
    sent = []

    class RecordingClient:
        def generate(self, prompt, **kwargs):
            sent.append((prompt, kwargs["add_special_tokens"]))

    generation = _chat_generation(chat_folders[folder], _chat(messages=_CONVERSATION, **extra))
    generation.shim._client = RecordingClient()
    generation.shim.triton_streams(generation.request, "id")
    tokenizer = AutoTokenizer.from_pretrained(chat_folders[folder])
    want = tokenizer.apply_chat_template(_CONVERSATION, tools=extra.get("tools"), tokenize=False,
                                         add_generation_prompt=True)
    assert sent == [(want, False)]
    # Tokenized as the llm model tokenizes it (no special tokens added), it is the template's own ids: one BOS.
    want_ids = tokenizer.apply_chat_template(_CONVERSATION, tools=extra.get("tools"), add_generation_prompt=True,
                                             return_dict=False)
    assert tokenizer(want, add_special_tokens=False).input_ids == want_ids


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
    (choice,) = asyncio.run(_completion_generation(request).run(stream))["choices"]
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
    events = _events(_completion_generation(request), stream)
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
    body = asyncio.run(_completion_generation(request).run(_responses((0, answer))))
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "length")
    assert choice["logprobs"]["tokens"] == ["Hel", "lo"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}

    streamed = parse_completion_request(_completion(echo=True, logprobs=1, max_tokens=0, stream=True))
    events = _events(_completion_generation(streamed), _responses((0, answer)))
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        ("Hello", None), ("", "length")]



def _failing_after(item: tuple[int, LLMResponse], error: Exception):
    async def stream():
        yield item
        raise error

    return stream()


def test_an_llm_error_mid_stream_is_an_error_event_naming_the_param_the_request_used(chat_folders):
    from pagedserve.backend.core.errors import InvalidRequestError, to_wire
    from pagedserve.client.triton_client import TritonRequestError

    generation = _chat_generation(chat_folders["bos"], _chat(stream=True, max_completion_tokens=50))
    refusal = InvalidRequestError("prompt (12 tokens) + max_tokens (50) must be <= max_model_len (40)", "max_tokens")
    stream = _failing_after((0, LLMResponse(["Hi"], [None], 12, [1])), TritonRequestError(to_wire(refusal)))
    events = _events(generation, stream)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "max_completion_tokens")
    assert error["message"] == "max_completion_tokens: prompt (12 tokens) + max_tokens (50) must be <= max_model_len (40)"
    assert [e["choices"][0]["delta"] for e in events[:-2]] == [{"role": "assistant", "content": ""}, {"content": "Hi"}]


def test_chat_create_renders_the_messages_with_the_model_folder_template(tmp_path):
    from pagedserve.testing import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    shim = OpenAIShim(ShimSettings(model_name="m", model_path=str(tmp_path)))
    generation = asyncio.run(ChatGeneration.create(shim, _chat()))
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert generation.request.prompts == [expected] and generation.id.startswith("chatcmpl-")
    completion = asyncio.run(CompletionGeneration.create(shim, _completion(prompt=[[1, 2], [3]])))
    assert completion.request.prompts == [[1, 2], [3]] and completion.id.startswith("cmpl-")
