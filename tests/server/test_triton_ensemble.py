"""The ensemble model (tokenize, stream through llm, detokenize) with the TensorRT-LLM tensor names: streamed
text is byte-exact, over HTTP and gRPC, and matches what the llm model says itself. Batches of several rows and
TensorRT-LLM's clients' exact requests: test_triton_ensemble_trtllm.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow

# Multi-byte characters and leading spaces; random-weight models also emit split and invalid UTF-8.
PROMPTS = ["The capital of France is", "Café, naïve, Zürich,", "日本語 and 🙂 and ✓", "  two leading spaces"]


def _sampled(seed: int) -> dict:
    return {"max_tokens": 24, "temperature": 1.0, "seed": seed, "exclude_input_in_output": True}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_http_generate_stream_through_the_ensemble_is_byte_exact(triton_server, prompt):
    body = {"text_input": prompt, **_sampled(seed=len(prompt))}
    events = triton_server.generate_stream("ensemble", {**body, "stream": True})
    whole = triton_server.generate("ensemble", body)
    assert events
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    sampling = {"max_tokens": 24, "temperature": 1.0, "seed": len(prompt)}
    llm = triton_server.generate(
        "llm", {"text_input": prompt, "sampling_parameters": sampling, "exclude_input_in_output": True}
    )
    assert whole["text_output"] == llm["text_output"]


def test_end_id_ends_the_ensemble_text_before_that_token_like_the_llm_text(triton_server):
    prompt = "Paged attention stores keys"
    greedy = {"text_input": prompt, "max_tokens": 12, "temperature": 0.0, "exclude_input_in_output": True,
              "return_num_output_tokens": True}
    full = triton_server.generate("llm", greedy)
    ids = json.loads(triton_server.generate("llm", {**greedy, "return_logprobs": True, "logprobs": 0})["logprobs"])
    end_id = ids[4]["token_id"]
    cut = [e["token_id"] for e in ids].index(end_id)
    llm = triton_server.generate("llm", {**greedy, "sampling_parameters": {"stop_token_ids": [end_id]},
                                         "return_finish_reason": True})
    assert llm["finish_reason"] == "stop" and llm["num_output_tokens"] == cut + 1
    # The end token's text is left out (as vLLM and TensorRT-LLM do), through the ensemble too, streamed or not.
    assert full["text_output"].startswith(llm["text_output"]) and llm["text_output"] != full["text_output"]
    body = {"text_input": prompt, "max_tokens": 12, "temperature": 0.0, "exclude_input_in_output": True,
            "end_id": end_id}
    assert triton_server.generate("ensemble", body)["text_output"] == llm["text_output"]
    events = triton_server.generate_stream("ensemble", {**body, "stream": True})
    assert "".join(e["text_output"] for e in events) == llm["text_output"]


def test_ensemble_without_exclude_input_returns_prompt_and_completion(triton_server):
    prompt = "Hello world"
    with_prompt = triton_server.generate("ensemble", {"text_input": prompt, "max_tokens": 6, "temperature": 0.0})
    without = triton_server.generate(
        "ensemble", {"text_input": prompt, "max_tokens": 6, "temperature": 0.0, "exclude_input_in_output": True}
    )
    assert with_prompt["text_output"] == prompt + without["text_output"]
    assert with_prompt["sequence_index"] == 0 and with_prompt["batch_index"] == 0


def test_grpc_stream_through_the_ensemble_with_trtllm_tensor_names(triton_server):
    # TensorRT-LLM's shapes: every input carries the batch dimension ([1, 1] here).
    values = {
        "text_input": np.array([[b"Paged attention stores keys"]], dtype=np.object_),
        "max_tokens": np.array([[10]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "top_k": np.array([[5]], dtype=np.int32),
        "seed": np.array([[3]], dtype=np.uint64),
        "return_log_probs": np.array([[True]]),
        "exclude_input_in_output": np.array([[True]]),
    }
    streamed = triton_server.grpc_stream("ensemble", {**values, "stream": np.array([[True]])})
    whole = triton_server.grpc_stream("ensemble", values)
    assert streamed.error is None and whole.error is None
    assert len(streamed.responses) == 10
    assert streamed.finals()[-1] and not any(streamed.finals()[:-1])
    assert "".join(streamed.texts()) == whole.texts()[0]
    # As TensorRT-LLM sends them: text_output [1], cum_log_probs [1, 1], output_log_probs [1, 1, tokens].
    assert [r.as_numpy("output_log_probs").shape for r in streamed.responses] == [(1, 1, 1)] * 10
    per_token = [float(r.as_numpy("output_log_probs")[0, 0, 0]) for r in streamed.responses]
    cumulative = float(streamed.responses[-1].as_numpy("cum_log_probs")[0, 0])
    assert cumulative == pytest.approx(sum(per_token), abs=1e-3)
    assert whole.responses[0].as_numpy("output_log_probs").shape == (1, 1, 10)
    assert whole.responses[0].as_numpy("text_output").shape == (1,)


def test_preprocessing_turns_trtllm_guided_decoding_into_the_llm_structured_outputs(triton_server):
    answer = triton_server.generate("preprocessing", {
        "text_input": "Hi", "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "integer"}'})
    assert json.loads(answer["sampling_parameters"])["structured_outputs"] == {"json": {"type": "integer"}}
    refused = triton_server.generate("preprocessing", {"text_input": "Hi", "guided_decoding_guide_type": "regex"})
    assert refused["error"].startswith("guided_decoding_guide must not be empty")
