"""Draft-model speculation: a tiny draft (the target itself, or another random model with its tokenizer)
proposes greedily; outputs equal those without speculation and transformers' greedy tokens, however the
steps are cut, and the KV blocks of both caches come back."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine, greedy
from tests.support.speculation import PROMPTS, all_outputs, assert_same, assert_speculated_and_all_free, run

SETTINGS = {"block_size": 4, "num_blocks": 128, "max_model_len": 256}


def draft(model, k: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def assert_self_draft_agrees_and_all_free(engine) -> None:
    """The target as its own draft, greedy: every draft is accepted, which only a draft KV cache holding the
    target's tokens gives; both caches' blocks are free again."""
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert_speculated_and_all_free(engine)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A one-layer random model with the target's tokenizer: it agrees with the target now and then."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=5, num_layers=1)


@pytest.fixture(scope="module")
def baseline(tiny_llama_path):
    return run(cpu_engine(tiny_llama_path, **SETTINGS), PROMPTS, greedy(40))


def test_greedy_equals_transformers_and_no_speculation(tiny_llama_path, baseline, hf_reference):
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=draft(tiny_llama_path, 3))
    got = run(engine, PROMPTS, greedy(40))
    assert_same(got, baseline)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"].token_ids == hf_reference.greedy(tiny_llama_path, prompt, 40)[0]
    assert_self_draft_agrees_and_all_free(engine)
    assert engine.speculator.runner.num_blocks > engine.get_stats().num_blocks  # its scratch blocks on top


@pytest.mark.parametrize("k", [1, 3, 5])
def test_another_draft_model_leaves_greedy_tokens_unchanged(tiny_llama_path, other_draft, baseline, k):
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=draft(other_draft, k))
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    stats = engine.get_stats()  # a random draft rarely agrees: the rejection path is what this test runs
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("settings", [{"max_num_batched_tokens": 7}, {"num_blocks": 26}],
                         ids=["chunked-prefill", "preemption"])
def test_equal_under_chunked_prefill_and_preemption(tiny_llama_path, baseline, settings):
    engine = cpu_engine(tiny_llama_path, **{**SETTINGS, **settings}, speculative_config=draft(tiny_llama_path, 4))
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    if "num_blocks" in settings:
        assert engine.get_stats().num_preemptions > 0
    assert_self_draft_agrees_and_all_free(engine)


def test_prefix_hits_n_and_stop_strings(tiny_llama_path, baseline):
    # A prompt continuing r0's output hits the blocks r0 cached, in both caches: the draft still agrees there.
    follow_up = [PROMPTS[0] + baseline["r0"].token_ids[:21]]
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=draft(tiny_llama_path, 3))
    run(engine, PROMPTS[:1], greedy(40))
    before = engine.get_stats()
    assert_same(run(engine, follow_up, greedy(30)), run(cpu_engine(tiny_llama_path, **SETTINGS), follow_up, greedy(30)))
    after = engine.get_stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 40
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert accepted == after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens > 0
    # Seeded n = 3 (its greedy drafts accepted only where the draw agrees) and a stop string.
    text = baseline["r1"].text
    prompts = [PROMPTS[1], PROMPTS[2]]
    params = [greedy(40, stop=[text[len(text) // 3 : len(text) // 3 + 3]]),
              SamplingParams(temperature=0.3, seed=4, n=3, max_tokens=30, ignore_eos=True)]
    want = all_outputs(cpu_engine(tiny_llama_path, **SETTINGS), prompts, params)
    got = all_outputs(engine, prompts, params)
    for rid, outs in want.items():
        assert [o.token_ids for o in got[rid]] == [o.token_ids for o in outs], rid
        assert [o.text for o in got[rid]] == [o.text for o in outs], rid
    assert_speculated_and_all_free(engine)


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model"),
        ({"method": "draft_model", "model": "/no/such/folder", "num_speculative_tokens": 3},
         "speculative_config.model"),
        ({"method": "ngram", "model": "/tmp", "num_speculative_tokens": 3}, "speculative_config.model"),
    ],
)
def test_bad_draft_configs_are_refused_naming_the_field(tiny_llama_path, value, field):
    with pytest.raises(InvalidRequestError) as info:
        LLMEngine.from_pretrained(str(tiny_llama_path), speculative_config=value)
    assert info.value.field == field


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_path, tmp_path):
    other = make_tiny_model(tmp_path / "wide", "llama", num_layers=1, config_extras={"vocab_size": 512})
    with pytest.raises(InvalidRequestError) as info:
        cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=draft(other, 2))
    assert info.value.field == "speculative_config.model"
