"""OpenAI request bodies translated for the llm model, and every refusal naming its field (no server needed)."""

from __future__ import annotations

import pytest

from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.protocol import parse_chat_request, parse_completion_request


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
        ({"logit_bias": {"50256": -101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"priority": 2**63}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
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
        ({"tools": [{"type": "function"}]}, "tools[0].function.name"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
        ({"guided_choice": []}, "structured_outputs"),
        ({"logit_bias": {"1": "5"}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a \ud800"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a", "name": 7}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
        ({"echo": "yes"}, "echo"),
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



def test_chat_prompts_get_no_special_tokens_added_unless_asked():
    assert parse_chat_request(_chat()).add_special_tokens is False
    assert parse_chat_request(_chat(add_special_tokens=True)).add_special_tokens is True
    assert parse_completion_request(_completion()).add_special_tokens is True
    assert _param_of(parse_chat_request, _chat(add_special_tokens="no")) == "add_special_tokens"


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert parse_completion_request(_completion(echo=True, logprobs=2)).sampling["prompt_logprobs"] == 2
    assert "prompt_logprobs" not in parse_completion_request(_completion(logprobs=2)).sampling
    assert "prompt_logprobs" not in parse_completion_request(_completion(echo=True)).sampling



def test_the_fields_vllm_router_adds_are_accepted_at_their_defaults_and_refused_otherwise():
    # What vllm-router 0.1.17 writes into every forwarded request (SGLang's names).
    added = {"no_stop_trim": False, "return_hidden_states": False}
    parse_completion_request(_completion(**added))
    parse_chat_request(_chat(**added, separate_reasoning=True, stream_reasoning=True))
    assert _param_of(parse_completion_request, _completion(no_stop_trim=True)) == "no_stop_trim"
    assert _param_of(parse_chat_request, _chat(return_hidden_states=True)) == "return_hidden_states"
    assert _param_of(parse_chat_request, _chat(separate_reasoning=False)) == "separate_reasoning"
    assert _param_of(parse_chat_request, _chat(surprise=1)) == "surprise"
