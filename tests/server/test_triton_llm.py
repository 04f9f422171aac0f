"""The `llm` model through the real tritonserver: gRPC streaming, HTTP generate / generate_stream,
n > 1, the return_* outputs, 32 concurrent streams, cancellation and metrics."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def test_grpc_stream_sends_one_response_per_token_and_final_flag_on_the_last(triton_server):
    result = triton_server.grpc_stream(
        "llm", {"text_input": "The capital of France is", "stream": True, "sampling_parameters": GREEDY,
                "return_num_output_tokens": True, "return_finish_reason": True},
    )
    assert result.error is None
    assert len(result.responses) == GREEDY["max_tokens"]
    assert result.counts() == list(range(1, GREEDY["max_tokens"] + 1))
    assert result.finals() == [False] * (GREEDY["max_tokens"] - 1) + [True]
    assert result.texts("finish_reason") == [""] * (GREEDY["max_tokens"] - 1) + ["length"]


def test_grpc_streamed_deltas_concatenate_to_the_non_streamed_text(triton_server):
    prompt = "Café, naïve, 日本語 and 🙂:"
    streamed = triton_server.grpc_stream(
        "llm", {"text_input": prompt, "stream": True, "sampling_parameters": {**GREEDY, "max_tokens": 24}}
    )
    whole = triton_server.grpc_stream(
        "llm", {"text_input": prompt, "sampling_parameters": {**GREEDY, "max_tokens": 24}}
    )
    assert streamed.error is None and whole.error is None
    assert len(whole.responses) == 1
    # Non-streamed text starts with the prompt (exclude_input_in_output defaults to false).
    assert whole.texts()[0] == prompt + "".join(streamed.texts())


def test_http_generate_echoes_the_prompt_unless_excluded(triton_server):
    body = {"text_input": "Hello there.", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    echoed = triton_server.generate("llm", body)
    plain = triton_server.generate("llm", {**body, "exclude_input_in_output": True})
    assert echoed["text_output"] == "Hello there." + plain["text_output"]
    assert plain["text_output"]


def test_http_generate_stream_deltas_equal_the_generate_text(triton_server):
    body = {"text_input": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "exclude_input_in_output": True, "return_finish_reason": True}
    events = triton_server.generate_stream("llm", {**body, "stream": True})
    whole = triton_server.generate("llm", body)
    assert len(events) == 16
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert [e["finish_reason"] for e in events][-1] == "length"


def test_n_returns_n_completions_in_one_response(triton_server):
    answer = triton_server.generate("llm", {
        "text_input": "Numbers", "exclude_input_in_output": True, "return_num_output_tokens": True,
        "sampling_parameters": {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 5, "ignore_eos": True},
    })
    assert isinstance(answer["text_output"], list) and len(answer["text_output"]) == 3
    assert answer["num_output_tokens"] == [5, 5, 5]


def test_return_flags_add_token_counts_finish_reason_and_logprobs(triton_server):
    prompt = "Hello world"
    answer = triton_server.generate("llm", {
        "text_input": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2,
        "exclude_input_in_output": True, "return_finish_reason": True, "return_num_input_tokens": True,
        "return_num_output_tokens": True, "return_cumulative_logprob": True, "return_logprobs": True,
    })
    assert answer["finish_reason"] == "length"
    assert answer["num_output_tokens"] == 4
    assert answer["num_input_tokens"] > 0
    entries = json.loads(answer["logprobs"])
    assert len(entries) == 4
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)
    # Greedy: the chosen token is the most likely one.
    assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in entries)
    assert answer["cumulative_logprob"] == pytest.approx(sum(e["logprob"] for e in entries), abs=1e-3)


def test_prompt_logprobs_match_transformers_and_come_once(triton_server, hf_reference):
    body = {"text_input": "The quick brown fox jumps over", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "prompt_logprobs": 2, "exclude_input_in_output": True,
            "return_num_input_tokens": True}
    answer = triton_server.generate("llm", body)
    entries = json.loads(answer["prompt_logprobs"])
    assert len(entries) == answer["num_input_tokens"] > 2
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] is None
    ids = [e["token_id"] for e in entries]
    expected = hf_reference.prompt_logprobs(triton_server.model_path, ids)
    assert [e["logprob"] for e in entries[1:]] == pytest.approx(expected, abs=1e-4)
    for entry in entries[1:]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True) and tops[0] >= entry["logprob"]

    # Streamed: only the first response carries them, the same ones.
    streamed = triton_server.grpc_stream(
        "llm", {"text_input": body["text_input"], "stream": True,
                "sampling_parameters": {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "prompt_logprobs": 2}},
    )
    assert streamed.error is None
    carried = [r.as_numpy("prompt_logprobs") for r in streamed.responses]
    assert [c is not None for c in carried] == [True, False, False]
    assert json.loads(carried[0].reshape(-1)[0]) == entries


def test_32_concurrent_greedy_streams_each_equal_their_solo_output(triton_server):
    prompts = [f"Request {i}: the quick brown fox number {i * 7}" for i in range(32)]
    params = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}

    def run(prompt: str, stream: bool) -> str:
        result = triton_server.grpc_stream(
            "llm", {"text_input": prompt, "stream": stream, "sampling_parameters": params,
                    "exclude_input_in_output": True},
        )
        assert result.error is None, result.error
        return "".join(result.texts())

    solo = [run(p, False) for p in prompts]
    with ThreadPoolExecutor(max_workers=32) as pool:
        concurrent = list(pool.map(lambda p: run(p, True), prompts))
    assert concurrent == solo


def _wait_for(condition, timeout: float = 60.0) -> bool:
    """Poll `condition` until it holds or `timeout` passes (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_cancelling_one_of_several_streams_ends_only_that_one(triton_server):
    before = triton_server.metric("vllm:generation_tokens_total")
    max_tokens = 200
    streams = [triton_server.open_stream("llm", {
        "text_input": f"Stream {i} counts:", "stream": True, "return_num_output_tokens": True,
        "sampling_parameters": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
    }) for i in range(4)]
    with streams[0] as victim:
        assert victim.next(timeout=60).error is None
        victim.close(cancel=True)
    for stream in streams[1:]:
        with stream:
            result = stream.collect(timeout=60)
        assert result.error is None
        assert result.counts() == list(range(1, max_tokens + 1))
    assert _wait_for(lambda: triton_server.metric("vllm:num_requests_running") == 0
                     and triton_server.metric("vllm:kv_cache_usage_perc") == 0.0)
    # The three survivors ran to the end; the cancelled one stopped short of it.
    generated = triton_server.metric("vllm:generation_tokens_total") - before
    assert 3 * max_tokens < generated < 4 * max_tokens


def test_metrics_page_carries_the_vllm_names(triton_server):
    triton_server.generate("llm", {"text_input": "Paged attention", "max_tokens": 3, "temperature": 0})
    text = triton_server.metrics_text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        # one instance, llm_0_0, of data-parallel rank 0 (vLLM's engine label)
        assert f'{name}{{engine="0",instance="llm_0_0",model="llm"' in text, name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert triton_server.metric(f"{name}_count") >= 1, name
    assert triton_server.metric("vllm:generation_tokens_total") >= 3
    # What a router's endpoint picker reads for prefix-aware scoring: the block size, on vLLM's info gauge.
    info = re.search(r'^vllm:cache_config_info\{([^}]*)\} (\S+)$', text, re.MULTILINE)
    assert info and float(info[2]) == 1.0, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
    assert labels["block_size"] == str(triton_server.engine_params.get("block_size", 16))
    assert int(labels["num_gpu_blocks"]) > 0 and labels["cache_dtype"] == "auto" and labels["engine"] == "0"


def test_genai_perf_vllm_payload_with_string_numbers_is_served(triton_server):
    # genai-perf --backend vllm --endpoint-type kserve --streaming --output-tokens-mean 32: its exact inputs.
    result = triton_server.grpc_stream("llm", {
        "text_input": "Tell me a story.", "stream": True, "exclude_input_in_output": True,
        "sampling_parameters": {"max_tokens": "32", "min_tokens": "32"},
        "return_num_output_tokens": True,
    })
    assert result.error is None, result.error
    assert result.counts()[-1] == 32
    refused = triton_server.grpc_stream("llm", {
        "text_input": "Tell me a story.", "sampling_parameters": {"max_tokens": "thirty-two"}})
    assert refused.responses == [] and "max_tokens must be an integer, got 'thirty-two'" in str(refused.error)
    # The HTTP generate endpoint's extra fields are converted the same way.
    body = {"text_input": "Hi", "max_tokens": "4", "min_tokens": "4", "temperature": "0",
            "exclude_input_in_output": True, "return_num_output_tokens": True}
    assert triton_server.generate("llm", body)["num_output_tokens"] == 4


def test_structured_outputs_in_sampling_parameters_constrain_the_text(triton_server):
    # vLLM's name (as Triton's vLLM backend takes it) and its older guided_* key.
    regex = triton_server.grpc_stream("llm", {
        "text_input": "Code:", "exclude_input_in_output": True,
        "sampling_parameters": {"temperature": 0.0, "max_tokens": 32, "structured_outputs": {"regex": "[a-c]{2,4}!"}},
    })
    assert regex.error is None and re.fullmatch(r"[a-c]{2,4}!", regex.texts()[0]), regex.texts()
    choice = triton_server.grpc_stream("llm", {
        "text_input": "Pick:", "exclude_input_in_output": True,
        "sampling_parameters": {"temperature": 1.0, "seed": 3, "max_tokens": 32, "guided_choice": ["red", "blue"]},
    })
    assert choice.error is None and choice.texts()[0] in ("red", "blue")
    refused = triton_server.grpc_stream("llm", {
        "text_input": "Code:", "sampling_parameters": {"structured_outputs": {"regex": "[a-"}}})
    assert refused.responses == [] and "structured_outputs.regex cannot be compiled" in str(refused.error)
