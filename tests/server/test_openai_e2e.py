"""The OpenAI shim against a real tritonserver (tiny Llama), driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = "The capital of France is"
IDLE_TIMEOUT_SECONDS = 60


@pytest.fixture(scope="module")
def shim_url(triton_server) -> Iterator[str]:
    """`python -m pagedserve.client.openai` in front of the session tritonserver."""
    with triton_server.openai_shim("--model-name", MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def client(shim_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shim_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(triton_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(triton_server.model_path))


def test_models_and_health_and_metrics_passthrough(client, shim_url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{shim_url}/health").status_code == 200
    metrics = httpx.get(f"{shim_url}/metrics").text
    assert "vllm:kv_cache_usage_perc" in metrics


def test_completion_counts_tokens_and_streaming_equals_whole_text(client, tokenizer):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    (choice,) = whole.choices
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert whole.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert 1 <= whole.usage.completion_tokens <= 12

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_batch_of_prompts_and_echo(client):
    result = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, echo=True)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].text.startswith(PROMPT) and result.choices[1].text.startswith("Hello")
    single = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert result.choices[1].text == "Hello" + single.choices[0].text


def test_token_id_prompt_completes_like_its_text(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + by_text.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_harness_asks(client, tokenizer, triton_server, hf_reference):
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs=1, one new token, greedy.
    ids = tokenizer(PROMPT + " Paris")["input_ids"]
    kwargs = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    (choice,) = client.completions.create(**kwargs).choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:-1] == pytest.approx(hf_reference.prompt_logprobs(triton_server.model_path, ids), abs=1e-4)
    assert choice.text == tokenizer.decode(ids) + logprobs.tokens[-1]
    # The greedy continuation is the top candidate; a prompt token's top candidate is at least as likely.
    assert logprobs.token_logprobs[-1] == pytest.approx(max(logprobs.top_logprobs[-1].values()))
    pairs = zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True)
    assert all(max(top.values()) >= lp - 1e-6 for lp, top in pairs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)


def test_echo_without_generation_scores_the_prompt_only(client, tokenizer, triton_server, hf_reference):
    # max_tokens 0 with echo (older lm-evaluation-harness releases ask this way), as vLLM answers it.
    ids = tokenizer(PROMPT)["input_ids"]
    result = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    (choice,) = result.choices
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(hf_reference.prompt_logprobs(triton_server.model_path, ids), abs=1e-4)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 0)


def test_chat_uses_the_chat_template_and_streams_the_same_text(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(tokenizer(rendered)["input_ids"])

    async def stream() -> list:
        async_client = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
        chunks = await async_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True})
        return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_two_gives_two_seeded_choices(client):
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=11, temperature=1.0)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=11, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=6, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_string_cuts_the_text_before_it(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {free!r}"
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[: free.index(stop)]


def test_logprobs_of_greedy_tokens_are_the_top_ones(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) <= 3 and chosen <= 0 and chosen == pytest.approx(max(top.values()))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_raw_sse_framing_ends_with_done(shim_url):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{shim_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_raw()).decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_requests_name_the_field(client, shim_url):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=3.0)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    # Only the engine knows the context length: its refusal comes back as a 400 too.
    too_long = " ".join(["word"] * 400)
    reply = httpx.post(f"{shim_url}/v1/completions", json={"model": MODEL, "prompt": too_long, "max_tokens": 4},
                       timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "prompt"
    # The llm model's wire tag is read, then left out of what the user sees.
    assert error["message"] and "[kind=" not in error["message"]


class _City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    population: int = pydantic.Field(ge=0, le=1000)


def test_response_format_json_schema_and_pydantic_parse_give_valid_json(client):
    schema = _City.model_json_schema()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city?"}], max_tokens=160, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Another?"}],
                                           max_tokens=160, temperature=0, response_format=_City)
    assert isinstance(parsed.choices[0].message.parsed, _City)


def test_vllm_extra_fields_constrain_completions(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=4,
                                      extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert reply.choices[0].text in ("Paris", "Lyon")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}})
    assert info.value.body["param"] == "response_format"
