"""The bad-input catalogue: every entry point (the `llm` and `ensemble` models over HTTP generate and gRPC
streams, the OpenAI shim, the in-process LLMEngine) refuses each bad request with an error that names the
field, in that protocol's error shape; afterwards a good request still succeeds and no KV block is held.

Cases already covered in tests/server/test_triton_errors.py and tests/engine/test_engine.py are not repeated.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from tests.support.engines import cpu_engine

pytestmark = pytest.mark.slow

GOOD_HTTP = {"text_input": "Hello", "max_tokens": 2, "temperature": 0}
TOO_MANY_TOKENS = "word " * 300  # over max_model_len (128) tokens, well under the byte limit
OVER_BYTE_LIMIT = "a" * ((1 << 20) + 1)


# name: (request body for POST /v2/models/llm/generate, field the message must name)
LLM_HTTP_CASES = {
    "temperature NaN": ({"text_input": "Hi", "sampling_parameters": '{"temperature": NaN}'}, "temperature"),
    "temperature infinite": ({"text_input": "Hi", "sampling_parameters": '{"temperature": Infinity}'},
                             "temperature"),
    "top_p zero": ({"text_input": "Hi", "top_p": 0}, "top_p"),
    "top_k negative": ({"text_input": "Hi", "top_k": -5}, "top_k"),
    "min_p above one": ({"text_input": "Hi", "min_p": 2.0}, "min_p"),
    "repetition_penalty zero": ({"text_input": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
    "presence_penalty out of range": ({"text_input": "Hi", "presence_penalty": 3.0}, "presence_penalty"),
    "frequency_penalty out of range": ({"text_input": "Hi", "frequency_penalty": -3.0}, "frequency_penalty"),
    "n above its limit": ({"text_input": "Hi", "sampling_parameters": {"n": 65}}, "n"),
    "seed negative": ({"text_input": "Hi", "sampling_parameters": {"seed": -1}}, "seed"),
    "seed over 2**63": ({"text_input": "Hi", "sampling_parameters": {"seed": 2**64}}, "seed"),
    "max_tokens over the context": ({"text_input": "Hi", "max_tokens": 1000}, "max_tokens"),
    "max_tokens as a word": ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": "five"}'}, "max_tokens"),
    "max_tokens as a float": ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": 5.5}'}, "max_tokens"),
    "min_tokens above max_tokens": ({"text_input": "Hi", "sampling_parameters": {"min_tokens": 9, "max_tokens": 3}},
                                    "min_tokens"),
    "17 stop strings": ({"text_input": "Hi", "sampling_parameters": {"stop": [f"s{i}" for i in range(17)]}},
                        "stop"),
    "stop string of 300 chars": ({"text_input": "Hi", "sampling_parameters": {"stop": ["x" * 300]}}, "stop"),
    "stop not strings": ({"text_input": "Hi", "sampling_parameters": {"stop": [1, 2]}}, "stop"),
    "stop_token_ids negative": ({"text_input": "Hi", "sampling_parameters": {"stop_token_ids": [-3]}},
                                "stop_token_ids"),
    "logprobs above 20": ({"text_input": "Hi", "sampling_parameters": {"logprobs": 21}}, "logprobs"),
    "prompt_logprobs above 20": ({"text_input": "Hi", "sampling_parameters": {"prompt_logprobs": 21}},
                                 "prompt_logprobs"),
    "ignore_eos not a bool": ({"text_input": "Hi", "sampling_parameters": '{"ignore_eos": 1}'}, "ignore_eos"),
    "unknown top-level parameter": ({"text_input": "Hi", "bogus_knob": 1}, "bogus_knob"),
    "sampling_parameters a JSON string": ({"text_input": "Hi", "sampling_parameters": '"greedy"'},
                                          "sampling_parameters"),
    "sampling_parameters over 64 KiB": ({"text_input": "Hi", "sampling_parameters": {"stop": ["x" * 70_000]}},
                                        "sampling_parameters"),
    "text_input over the byte limit": ({"text_input": OVER_BYTE_LIMIT}, "text_input"),
    "prompt over max_model_len tokens": ({"text_input": TOO_MANY_TOKENS, "max_tokens": 1}, "prompt"),
    "beam search with stop strings": ({"text_input": "Hi", "sampling_parameters": {"beam_width": 2, "stop": ["."]}},
                                      "stop"),
    "n above beam_width": ({"text_input": "Hi", "sampling_parameters": {"beam_width": 2, "n": 3}}, "n"),
}


# name: (gRPC stream inputs of the llm model, text the error must contain)
LLM_GRPC_CASES = {
    "text_input sent as INT32": ({"text_input": np.array([7], dtype=np.int32)}, "text_input"),
    "text_input with two elements": ({"text_input": ["a", "b"]}, "text_input"),
    "an input the model does not have": ({"text_input": "Hi", "prompt": "Hi"}, "prompt"),
    "stream sent as INT32": ({"text_input": "Hi", "stream": np.array([1], dtype=np.int32)}, "stream"),
    "sampling_parameters not UTF-8": ({"text_input": "Hi", "sampling_parameters": b"{\xff}"},
                                      "sampling_parameters"),
    "neither text_input nor input_ids": ({"stream": True}, "text_input"),
    "both text_input and input_ids": ({"text_input": "Hi", "input_ids": np.array([1, 2], dtype=np.int32)},
                                      "input_ids"),
    "input_ids empty": ({"input_ids": np.zeros(0, dtype=np.int32)}, "input_ids"),
    "input_ids outside the vocabulary": ({"input_ids": np.array([1, 100_000], dtype=np.int32)},
                                         "prompt_token_ids"),
    "input_ids negative": ({"input_ids": np.array([1, -7], dtype=np.int32)}, "prompt_token_ids"),
    "input_ids over max_model_len": ({"input_ids": np.full(200, 5, dtype=np.int32)}, "max_model_len"),
}


@pytest.mark.parametrize("values, field", LLM_GRPC_CASES.values(), ids=LLM_GRPC_CASES.keys())
def test_llm_grpc_stream_ends_with_one_error_naming_the_field(small_pool_server, values, field):
    result = small_pool_server.grpc_stream("llm", values)
    assert result.responses == [] and result.error is not None
    assert field in str(result.error)
    good = small_pool_server.grpc_stream("llm", {"text_input": "Hi", "sampling_parameters": {"max_tokens": 2}})
    assert good.error is None and good.texts()[0].startswith("Hi")
    small_pool_server.wait_idle()


ENSEMBLE_HTTP_CASES = {
    "empty text_input": ({"text_input": ""}, "text_input"),
    "bad_words blank": ({"text_input": "Hi", "bad_words": [" "]}, "bad_words"),
    "top_p zero": ({"text_input": "Hi", "top_p": 0.0}, "top_p"),
    "temperature negative": ({"text_input": "Hi", "temperature": -1.0}, "temperature"),
    "max_tokens negative": ({"text_input": "Hi", "max_tokens": -3}, "max_tokens"),
    "seed over 2**63": ({"text_input": "Hi", "seed": 2**64 - 1}, "seed"),
    "max_tokens over the context": ({"text_input": "Hi", "max_tokens": 500}, "max_tokens"),
    "prompt over max_model_len tokens": ({"text_input": TOO_MANY_TOKENS, "max_tokens": 1}, "max_model_len"),
}


HTTP_CASES = [
    pytest.param(model, body, field, id=f"{model}: {name}")
    for model, cases in (("llm", LLM_HTTP_CASES), ("ensemble", ENSEMBLE_HTTP_CASES))
    for name, (body, field) in cases.items()
]


@pytest.mark.parametrize("model, body, field", HTTP_CASES)
def test_http_generate_refuses_with_400_naming_the_field(small_pool_server, model, body, field):
    status, text = small_pool_server.post(f"/v2/models/{model}/generate", body)
    assert status == 400, text
    assert field in json.loads(text)["error"]
    assert small_pool_server.generate(model, GOOD_HTTP)["text_output"].startswith("Hello")
    small_pool_server.wait_idle()


def test_ensemble_grpc_refuses_a_wrongly_typed_tensor_naming_it(small_pool_server):
    # TensorRT-LLM's shapes: every input carries the batch dimension.
    text = np.array([[b"Hi"]], dtype=np.object_)
    result = small_pool_server.grpc_stream(
        "ensemble", {"text_input": text, "max_tokens": np.array([[3.0]], dtype=np.float32)}
    )
    assert result.responses == [] and "max_tokens" in str(result.error)
    good = small_pool_server.grpc_stream("ensemble", {"text_input": text, "max_tokens": np.array([[2]], np.int32)})
    assert good.error is None
    small_pool_server.wait_idle()


def _raw_json(settings: dict) -> bytes:
    return json.dumps(settings).encode()  # allow_nan: NaN goes out as the NaN token


# name: (path, body, OpenAI `param` expected)
OPENAI_CASES = {
    "top_p zero": ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
    "temperature NaN": ("/v1/completions", {"prompt": "Hi", "temperature": float("nan")}, "temperature"),
    "n above its limit": ("/v1/completions", {"prompt": "Hi", "n": 100}, "n"),
    "seed negative": ("/v1/completions", {"prompt": "Hi", "seed": -1}, "seed"),
    "logprobs above 20": ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    "17 stop strings": ("/v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    "presence_penalty a string": ("/v1/completions", {"prompt": "Hi", "presence_penalty": "high"},
                                  "presence_penalty"),
    "unknown field": ("/v1/completions", {"prompt": "Hi", "temprature": 0.5}, "temprature"),
    "token ids outside the vocabulary": ("/v1/completions", {"prompt": [1, 100_000]}, "prompt"),
    "a negative token id, echoed": ("/v1/completions", {"prompt": [5, -3], "echo": True}, "prompt"),
    "a lone surrogate in the prompt": ("/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
    "a lone surrogate in a chat message": ("/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "Hi \udfff"}]},
                                           "messages[0].content"),
    "prompt over max_model_len tokens": ("/v1/completions", {"prompt": TOO_MANY_TOKENS, "max_tokens": 1}, "prompt"),
    "max_tokens over the context": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1000}, "max_tokens"),
    "chat top_logprobs above 20": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "chat unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]},
                          "messages[0].role"),
    "chat empty messages": ("/v1/chat/completions", {"messages": []}, "messages"),
}


@pytest.mark.parametrize("path, body, param", OPENAI_CASES.values(), ids=OPENAI_CASES.keys())
def test_openai_shim_refuses_with_error_json_naming_the_param(shim_url, small_pool_server, path, body,
                                                              param):
    reply = httpx.post(f"{shim_url}{path}", content=_raw_json({"model": "tiny", **body}),
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    good = httpx.post(f"{shim_url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                      timeout=60)
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("stop", "length")
    small_pool_server.wait_idle()


@pytest.fixture(scope="module")
def engine(tiny_llama_path) -> LLMEngine:
    return cpu_engine(tiny_llama_path, block_size=4, num_blocks=32, max_model_len=64)


ENGINE_CASES = {
    "prompt as bytes": ({"prompt": b"Hi"}, "prompt"),
    "prompt_token_ids floats": ({"prompt": None, "prompt_token_ids": [1.0, 2.0]}, "prompt_token_ids"),
    "prompt_token_ids bools": ({"prompt": None, "prompt_token_ids": [True]}, "prompt_token_ids"),
    "max_tokens over the context": ({"params": SamplingParams(max_tokens=64)}, "max_tokens"),
    "beam width whose beams cannot fit the pool": ({"params": SamplingParams(beam_width=8, n=1, max_tokens=40)},
                                                   "beam_width"),
    "prompt_logprobs with beam search": ({"params": SamplingParams(beam_width=2, prompt_logprobs=1)},
                                         "prompt_logprobs"),
}


@pytest.mark.parametrize("kwargs, field", ENGINE_CASES.values(), ids=ENGINE_CASES.keys())
def test_engine_refuses_naming_the_field_and_serves_on(engine, kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", **{"prompt": "Hi", **kwargs})
    assert info.value.field == field and field in str(info.value)
    assert not engine.has_unfinished_requests()
    good = engine.generate("Hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(good.outputs[0].token_ids) == 3
    assert engine.get_stats().kv_cache_usage == 0.0
