"""Random sampling parameters thrown at the in-process engine: each set is either refused cleanly
(InvalidRequestError naming a field, nothing queued) or served to a normal finish; never a crash, never a
leaked KV block."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from tests.support.engines import cpu_engine

MAX_STEPS = 400  # far more than any accepted request needs at max_model_len 48; a liveness bound

_junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)
_edge_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 70),
    st.sampled_from([0, -1, 21, 2**63, -(2**63), 1e308]),
)
_edge = st.one_of(_junk, _edge_numbers, st.lists(st.text(max_size=300), max_size=18))
_PLAUSIBLE = {
    "n": st.integers(1, 4), "beam_width": st.integers(1, 3), "length_penalty": st.floats(0.5, 2.0),
    "temperature": st.one_of(st.just(0), st.floats(0.0, 2.0)), "top_k": st.integers(-1, 50),
    "top_p": st.floats(0.01, 1.0), "min_p": st.floats(0.0, 1.0), "repetition_penalty": st.floats(0.5, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
    "seed": st.integers(0, 2**63 - 1), "max_tokens": st.one_of(st.none(), st.integers(1, 30)),
    "min_tokens": st.integers(0, 5), "stop": st.one_of(st.text(min_size=1, max_size=3),
                                                       st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)), "prompt_logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}
_keys = st.lists(st.sampled_from(sorted(_PLAUSIBLE)), max_size=6, unique=True)
# Half the sets are plausible throughout (served or refused for a cross-field reason), half carry edge values
# or an unknown key.
_param_sets = st.one_of(
    _keys.flatmap(lambda keys: st.fixed_dictionaries({k: _PLAUSIBLE[k] for k in keys})),
    st.lists(st.sampled_from(sorted(_PLAUSIBLE) + ["best_off"]), min_size=1, max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: st.one_of(_PLAUSIBLE[k], _edge) if k in _PLAUSIBLE else _junk
                                            for k in keys})
    ),
)


@pytest.fixture(scope="module")
def engine(tiny_llama_path) -> LLMEngine:
    return cpu_engine(tiny_llama_path, block_size=4, num_blocks=64, max_model_len=48)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(settings_dict=_param_sets)
def test_random_sampling_parameters_are_validated_or_refused_never_crash(engine, settings_dict):
    try:
        params = SamplingParams.from_dict(dict(settings_dict))
        engine.add_request("fuzz", "The quick brown fox", params)
    except InvalidRequestError as error:
        assert isinstance(error.field, str) and error.field
        event(f"refused: {error.field}")
        assert error.field in settings_dict or error.field in ("max_tokens", "sampling_parameters")
        assert not engine.has_unfinished_requests()
        assert engine.get_stats().kv_cache_usage == 0.0
        return
    event("served")
    final = None
    for _ in range(MAX_STEPS):
        for output in engine.step():
            if output.finished:
                final = output
        if not engine.has_unfinished_requests():
            break
    assert final is not None and final.error is None
    assert len(final.outputs) == params.n
    for completion in final.outputs:
        assert completion.finish_reason in ("stop", "length")
        assert len(completion.token_ids) <= (params.max_tokens or 48)
        if completion.cumulative_logprob is not None:
            assert not math.isnan(completion.cumulative_logprob)
    assert engine.get_stats().kv_cache_usage == 0.0
