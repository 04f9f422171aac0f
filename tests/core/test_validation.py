"""Bad input is refused with an InvalidRequestError that names the field and the allowed range."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"temperature": -0.1}, "temperature", "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature", "temperature must be finite"),
        ({"n": 0}, "n", "n must be in [1, 64], got 0"),
        ({"n": 65}, "n", "n must be in [1, 64]"),
        ({"n": 4, "beam_width": 2}, "n", "n must be <= beam_width (2)"),
        ({"top_k": -2}, "top_k", "top_k must be >= -1"),
        ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"seed": -1}, "seed", "seed must be in [0, 9223372036854775807]"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens must be <= max_tokens (8)"),
        ({"stop": [""]}, "stop", "1..256 characters"),
        ({"stop": ["x"] * 17}, "stop", "at most 16 strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "integers >= 0"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
        # length**2000 overflows a float (and length**-2000 is 0.0): it would fail the whole step.
        ({"beam_width": 2, "length_penalty": 2000.0}, "length_penalty", "length_penalty must be in [-50, 50]"),
        ({"beam_width": 2, "length_penalty": -51}, "length_penalty", "length_penalty must be in [-50, 50]"),
    ],
)
def test_out_of_range_values_name_the_field_and_range(kwargs, field, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("d", "field"),
    [
        ({"n": True}, "n"),
        ({"max_tokens": 1.0}, "max_tokens"),
        ({"temperature": "warm"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"seed": "seven"}, "seed"),
        ({"max_tokens": "3.5"}, "max_tokens"),
        ({"max_tokens": ""}, "max_tokens"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"temperature": "nan"}, "temperature"),
        ({"top_p": "1.5"}, "top_p"),
    ],
)
def test_from_dict_refuses_wrong_types(d, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(d)
    assert info.value.field == field


def test_from_dict_converts_strings_by_the_fields_type_as_the_vllm_backend_does():
    # genai-perf --backend vllm --output-tokens-mean 32 sends exactly this.
    params = SamplingParams.from_dict({"max_tokens": "32", "min_tokens": "32"})
    assert (params.max_tokens, params.min_tokens) == (32, 32)
    params = SamplingParams.from_dict({"temperature": "0.7", "top_p": " 0.9 ", "seed": "7", "n": "2",
                                       "ignore_eos": "true", "skip_special_tokens": "False", "logprobs": "1"})
    assert (params.temperature, params.top_p, params.seed, params.n) == (0.7, 0.9, 7, 2)
    assert params.ignore_eos is True and params.skip_special_tokens is False and params.logprobs == 1
    # String-typed fields keep their string.
    assert SamplingParams.from_dict({"stop": "32"}).stop == ["32"]


def test_from_dict_refuses_unknown_keys_and_non_objects():
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter 'best_off'") as info:
        SamplingParams.from_dict({"best_off": 2})
    assert info.value.field == "best_off"
    with pytest.raises(InvalidRequestError, match="must be a JSON object") as info:
        SamplingParams.from_dict([("n", 1)])
    assert info.value.field == "sampling_parameters"


def test_from_dict_accepts_valid_values_and_normalises_them():
    params = SamplingParams.from_dict(
        {"temperature": 0, "top_p": 1, "stop": "###", "max_tokens": None, "seed": 3, "logprobs": 0}
    )
    assert params.is_greedy and params.temperature == 0.0
    assert params.stop == ["###"] and params.max_tokens is None and params.logprobs == 0
    assert not SamplingParams().is_greedy


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: CacheConfig(block_size=12), "block_size"),
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(num_blocks=0), "num_blocks"),
        (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda: CacheConfig(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=-4), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(max_model_len=2.5), "max_model_len"),
        (lambda: SchedulerConfig(max_num_waiting=0), "max_num_waiting"),
        (lambda: ModelConfig(""), "model"),
        (lambda: ModelConfig("m", dtype="fp8"), "dtype"),
        (lambda: ModelConfig("m", device="tpu"), "device"),
    ],
)
def test_bad_config_values_name_the_field(factory, field):
    with pytest.raises(InvalidRequestError) as info:
        factory()
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": "a", "prompt_token_ids": []}, "prompt_token_ids"),
        ({"request_id": "a", "prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"request_id": "a", "prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
        ({"request_id": "a", "prompt_token_ids": [1], "cache_salt": 5}, "cache_salt"),
    ],
)
def test_bad_request_fields_are_named(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        Request(**kwargs)
    assert info.value.field == field


def test_request_keeps_all_tokens_in_step_and_reports_finish_reason():
    request = Request("a", [5, 6], SamplingParams(max_tokens=3))
    request.append_output_token_id(7)
    assert request.all_token_ids == [5, 6, 7] and request.num_tokens == 3 and request.num_output_tokens == 1
    assert request.last_token_id == 7 and request.max_tokens == 3
    assert request.finish_reason is None and not request.is_finished
    request.status = RequestStatus.FINISHED_LENGTH
    assert request.finish_reason == "length" and request.is_finished
    assert [RequestStatus.is_finished(s) for s in RequestStatus] == [
        False,
        False,
        False,
        True,
        True,
        True,
        True,
    ]
