"""The rest of the OpenAI / vLLM request surface through the shim and a real tritonserver (tiny Llama):
logit_bias, the vLLM logits fields, stream_options' continuous usage, user, several served names with
max_model_len, and vLLM's /tokenize and /detokenize checked against the engine's own prompt count."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL, ALIAS = "tiny-llama", "tiny-alias"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def shim_url(triton_server) -> Iterator[str]:
    with triton_server.openai_shim("--model-name", MODEL, ALIAS) as url:
        yield url


@pytest.fixture(scope="module")
def client(shim_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim_url}/v1", api_key="unused", max_retries=0)


def _post(shim_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{shim_url}{path}", json=body, timeout=60)


def test_every_served_name_is_listed_with_max_model_len_and_answers(client, triton_server):
    cards = client.models.list().data
    assert [card.id for card in cards] == [MODEL, ALIAS]
    config = json.loads((triton_server.model_path / "config.json").read_text())
    expected = int(triton_server.engine_params.get("max_model_len") or config["max_position_embeddings"])
    assert all(card.model_extra["max_model_len"] == expected for card in cards)
    reply = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2, temperature=0)
    assert reply.model == ALIAS and reply.choices[0].text


def test_tokenize_counts_what_the_engine_counts_and_detokenize_inverts_it(client, shim_url):
    tokens = _post(shim_url, "/tokenize", {"model": MODEL, "prompt": PROMPT}).json()
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).usage
    assert tokens["count"] == len(tokens["tokens"]) == usage.prompt_tokens
    assert tokens["max_model_len"] > 0
    text = _post(shim_url, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith(PROMPT)
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = _post(shim_url, "/tokenize", {"model": MODEL, "messages": chat}).json()
    usage = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, temperature=0).usage
    assert rendered["count"] == usage.prompt_tokens


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "colour": 1}, "colour"),
    ("/detokenize", {"model": MODEL, "tokens": ["a"]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10**8]}, "tokens"),
])
def test_bad_tokenize_bodies_are_refused_naming_the_field(shim_url, path, body, param):
    answer = _post(shim_url, path, body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert _post(shim_url, "/tokenize", {"model": "nope", "prompt": "a"}).status_code == 404


def test_logit_bias_and_vllm_logits_fields_reach_the_engine(client, shim_url):
    token = _post(shim_url, "/tokenize", {"model": MODEL, "prompt": " Paris", "add_special_tokens": False})
    paris = token.json()["tokens"][-1]
    biased = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(paris): 100})
    assert biased.choices[0].text == _post(shim_url, "/detokenize", {"model": MODEL, "tokens": [paris] * 4}
                                           ).json()["prompt"]
    allowed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1,
                                        extra_body={"allowed_token_ids": [paris], "ignore_eos": True})
    assert allowed.usage.completion_tokens == 6
    bad = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, user="alice",
                                    extra_body={"bad_words": ["Paris"], "truncate_prompt_tokens": 3})
    assert bad.usage.prompt_tokens == 3 and "Paris" not in bad.choices[0].text


def test_a_bad_logit_bias_is_refused_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"5": 500})
    assert info.value.body["param"] == "logit_bias"


def test_a_priority_the_fcfs_engine_would_not_honour_is_refused_as_vllm_does(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": -5})
    assert info.value.body["param"] == "priority" and "priority scheduling policy" in info.value.message
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 0})


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_chat_echo_continues_the_final_assistant_message_streamed_and_whole(client, shim_url):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=extra)
    content = whole.choices[0].message.content
    assert content.startswith("My answer is") and len(content) > len("My answer is")
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body=extra, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    # The prompt ends inside the assistant's turn: the same as the completion of its rendered text.
    rendered = _post(shim_url, "/tokenize", {"model": MODEL, "messages": messages,
                                             "add_generation_prompt": False}).json()
    assert rendered["count"] > whole.usage.prompt_tokens  # the closed turn's end-of-turn tokens are cut
