"""N-gram speculative decoding: greedy outputs equal those without it, however the steps are cut, and the
KV blocks of rejected drafts come back."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.backend.core.config import SpeculativeConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.outputs import CompletionOutput
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.engine.spec_decode import ngram_lookup
from pagedserve.backend.triton.settings import engine_arguments
from tests.support.engines import cpu_engine, greedy
from tests.support.speculation import PROMPTS, assert_same, assert_speculated_and_all_free, run, spec


@pytest.fixture(scope="module")
def baseline(tiny_llama_path) -> dict[str, CompletionOutput]:
    return run(cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256), PROMPTS, greedy(40))


def test_the_baseline_is_transformers_greedy_output(tiny_llama_path, baseline, hf_reference):
    for i, prompt in enumerate(PROMPTS):
        assert baseline[f"r{i}"].token_ids == hf_reference.greedy(tiny_llama_path, prompt, 40)[0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_tokens_without_speculation(tiny_llama_path, baseline, k):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256, speculative_config=spec(k))
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    assert_speculated_and_all_free(engine)


def test_equal_under_chunked_prefill_and_a_small_token_budget(tiny_llama_path, baseline):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256,
                        max_num_batched_tokens=7, speculative_config=spec(5))
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    assert_speculated_and_all_free(engine)


def test_equal_when_a_tiny_kv_pool_forces_preemption(tiny_llama_path, baseline):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=26, max_model_len=256, speculative_config=spec(3))
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    assert engine.get_stats().num_preemptions > 0
    assert_speculated_and_all_free(engine)


def test_equal_with_prefix_cache_hits_on_accepted_tokens(tiny_llama_path, baseline):
    # The second prompt continues the first request's output, whose blocks were cached as accepted.
    follow_up = [PROMPTS[0] + baseline["r0"].token_ids[:21]]
    plain = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256)
    want = run(plain, follow_up, greedy(30))
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256, speculative_config=spec(3))
    run(engine, PROMPTS[:1], greedy(40))
    hits = engine.get_stats().prefix_cache_hits
    assert_same(run(engine, follow_up, greedy(30)), want)
    assert engine.get_stats().prefix_cache_hits - hits >= 40
    assert_speculated_and_all_free(engine)


def test_stop_strings_stop_ids_and_max_tokens_cut_the_accepted_run_exactly(tiny_llama_path, baseline):
    text, ids = baseline["r1"].text, baseline["r1"].token_ids
    params = [
        greedy(40, stop=[text[len(text) // 3 : len(text) // 3 + 3]]),
        greedy(40, stop_token_ids=[ids[17]]),
        greedy(13),
        SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2 : len(text) // 2 + 2]],
                       include_stop_str_in_output=True, ignore_eos=True),
    ]
    prompts = [PROMPTS[1]] * len(params)
    want = run(cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256), prompts, params)
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256, speculative_config=spec(5))
    got = run(engine, prompts, params)
    assert_same(got, want)
    assert [len(want[f"r{i}"].token_ids) < 40 for i in range(4)] == [True] * 4
    assert_speculated_and_all_free(engine)


def test_mixed_batch_leaves_sampled_requests_as_without_speculation(tiny_llama_path):
    sampled = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=30, ignore_eos=True) for i in range(2)]
    params = [greedy(40), sampled[0], greedy(40), sampled[1], SamplingParams(temperature=0, max_tokens=30,
                                                                             logprobs=2, ignore_eos=True)]
    prompts = PROMPTS + [PROMPTS[0]]
    want = run(cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256), prompts, params)
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256, speculative_config=spec(3))
    got = run(engine, prompts, params)
    assert_same(got, want)
    assert [sorted(d) for d in got["r4"].logprobs] == [sorted(d) for d in want["r4"].logprobs]
    assert_speculated_and_all_free(engine)


def test_speculation_is_off_by_default(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256)
    run(engine, PROMPTS, greedy(20))
    assert engine.speculator is None
    assert engine.get_stats().spec_decode_num_drafts == 0


def test_the_config_pbtxt_parameter_reaches_the_engine_as_json(tiny_llama_path, baseline):
    _, kwargs = engine_arguments({"speculative_config": {"string_value": '{"num_speculative_tokens": 2, '
                                                                         '"prompt_lookup_max": 2}'}})
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256, **kwargs)
    assert engine.speculator.config.num_speculative_tokens == 2
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    assert engine_arguments({"speculative_config": {"string_value": ""}})[1] == {}


def test_json_text_config_is_taken_as_a_dict():
    config = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (4, 3, 3)
    assert SpeculativeConfig.from_value({"num_speculative_tokens": 2}).prompt_lookup_min == 5  # vLLM's default
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative_config.prompt_lookup_min"),
        ({"num_speculative_tokens": 3, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
        ({"num_speculative_tokens": 3, "lookahead": 1}, "speculative_config.lookahead"),
        ({"num_speculative_tokens": 3, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ("{not json", "speculative_config"),
        ([3], "speculative_config"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_field(tiny_llama_path, value, field):
    with pytest.raises(InvalidRequestError) as info:
        LLMEngine.from_pretrained(str(tiny_llama_path), speculative_config=value)
    assert info.value.field == field


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = np.array([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3])
    assert ngram_lookup(tokens, 1, 3, 2) == [9, 2]  # "1 2 3" at the start beats the later "2 3"
    assert ngram_lookup(tokens, 1, 2, 2) == [7, 8]  # n = 2: the latest "2 3"
    assert ngram_lookup(tokens, 1, 3, 10) == [9, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(np.array([4, 5, 6, 7]), 1, 3, 3) == []
    assert ngram_lookup(np.array([4, 4]), 1, 3, 3) == [4]
    assert ngram_lookup(np.array([1, 2, 1, 3, 1, 2]), 3, 3, 3) == []
