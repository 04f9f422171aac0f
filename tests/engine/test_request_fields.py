"""vLLM request fields the engine honours outside sampling: truncate_prompt_tokens."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.engines import cpu_engine

GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return cpu_engine(tiny_llama_path, num_blocks=64, max_model_len=64)


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    ids = list(range(5, 45))
    cut = engine.generate([ids], SamplingParams(**GREEDY, truncate_prompt_tokens=10))[0]
    tail = engine.generate([ids[-10:]], SamplingParams(**GREEDY))[0]
    assert cut.prompt_token_ids == ids[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids


def test_truncate_prompt_tokens_minus_one_fits_an_overlong_prompt(engine):
    out = engine.generate([list(range(5, 105))], SamplingParams(**{**GREEDY, "max_tokens": None},
                                                                      truncate_prompt_tokens=-1))[0]
    assert len(out.prompt_token_ids) == 63 and len(out.outputs[0].token_ids) == 1


@pytest.mark.parametrize("value", [0, -2, "x"])
def test_a_bad_truncate_prompt_tokens_is_refused_naming_it(value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"truncate_prompt_tokens": value})
    assert info.value.field == "truncate_prompt_tokens"
