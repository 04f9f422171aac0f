"""The engine's features on an fp8 KV cache: prefix caching, copy-on-write, preemption, LoRA, beams and
speculative decoding each give what the same fp8 engine gives without them (the cache's bytes are the same
whichever way a block came to hold them)."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.testing import make_lora_adapter
from tests.support.engines import cpu_engine, greedy
from tests.support.speculation import PROMPTS, assert_same, assert_speculated_and_all_free, run, spec

FP8 = {"kv_cache_dtype": "fp8", "block_size": 4}


def _tokens(engine, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def roomy_greedy(tiny_llama_path) -> list[list[list[int]]]:
    return _tokens(cpu_engine(tiny_llama_path, num_blocks=256, **FP8), PROMPTS, greedy(16))


def test_prefix_cache_hits_read_the_fp8_blocks_another_request_wrote(tiny_llama_path, roomy_greedy):
    engine = cpu_engine(tiny_llama_path, num_blocks=256, **FP8)
    first = engine.generate([PROMPTS[2]], greedy(16))[0]
    again = engine.generate([PROMPTS[2]], greedy(16))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == roomy_greedy[2][0]


def test_copy_on_write_forks_keep_the_shared_fp8_prompt(tiny_llama_path, roomy_greedy):
    # n = 3 greedy children share the prompt's blocks; each copies the last, partial one before writing into it.
    engine = cpu_engine(tiny_llama_path, num_blocks=256, **FP8)
    children = _tokens(engine, [PROMPTS[3]], greedy(16, n=3))[0]
    assert children == [roomy_greedy[3][0]] * 3


def test_preempted_sequences_recompute_into_fp8_blocks_and_end_alike(tiny_llama_path, roomy_greedy):
    tight = cpu_engine(tiny_llama_path, num_blocks=26, max_num_batched_tokens=8, **FP8)
    assert _tokens(tight, PROMPTS, greedy(16)) == roomy_greedy
    assert tight.get_stats().num_preemptions > 0


def test_beams_on_fp8_survive_preemption(tiny_llama_path):
    params = SamplingParams(beam_width=4, n=2, max_tokens=12, ignore_eos=True)
    expected = _tokens(cpu_engine(tiny_llama_path, num_blocks=256, **FP8), PROMPTS, params)
    tight = cpu_engine(tiny_llama_path, num_blocks=24, max_num_batched_tokens=8, **FP8)
    assert _tokens(tight, PROMPTS, params) == expected
    assert tight.get_stats().num_preemptions > 0
    assert all(len(beams) == 2 and beams[0] != beams[1] for beams in expected)


def test_ngram_speculation_on_fp8_equals_decoding_without_it(tiny_llama_path):
    settings = dict(num_blocks=128, max_model_len=256, **FP8)
    baseline = run(cpu_engine(tiny_llama_path, **settings), PROMPTS, greedy(40))
    engine = cpu_engine(tiny_llama_path, speculative_config=spec(3), **settings)
    assert_same(run(engine, PROMPTS, greedy(40)), baseline)
    assert_speculated_and_all_free(engine)


def test_lora_adapters_on_fp8_match_each_request_alone(tiny_llama_path, tmp_path):
    adapter = make_lora_adapter(tiny_llama_path, tmp_path / "a1", rank=8, seed=1)
    engine = cpu_engine(tiny_llama_path, enable_lora=True, max_loras=1, num_blocks=128,
                        lora_modules={"a1": str(adapter)}, **FP8)
    params = [greedy(12, lora_name=name) for name in ("a1", None, "a1", None)]
    mixed = _tokens(engine, PROMPTS, params)
    alone = [_tokens(engine, [prompt], [p])[0] for prompt, p in zip(PROMPTS, params, strict=True)]
    assert mixed == alone
    base = _tokens(engine, [PROMPTS[0]], greedy(12))[0]
    assert mixed[0] != base, "the adapter changes the output"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_on_fp8_kv_stay_close_to_their_bf16_kv(tiny_llama_path, quantization):
    from tests.support.kv_cache_dtype import first_token_logits, make_engine, mean_kl, prompts_for

    prompts = prompts_for(300, 8, seed=9)
    bf16, fp8 = (make_engine(tiny_llama_path, kv, quantization=quantization) for kv in ("auto", "fp8"))
    assert mean_kl(first_token_logits(bf16, prompts)[0], first_token_logits(fp8, prompts)[0]) <= 1e-2


def test_a_draft_model_on_fp8_kv_equals_decoding_without_it(tiny_llama_path):
    # The target as its own draft: the draft's cache is fp8 too, so greedy drafts are all accepted.
    settings = dict(num_blocks=128, max_model_len=256, **FP8)
    baseline = run(cpu_engine(tiny_llama_path, **settings), PROMPTS, greedy(24))
    draft = {"method": "draft_model", "model": str(tiny_llama_path), "num_speculative_tokens": 3}
    engine = cpu_engine(tiny_llama_path, speculative_config=draft, **settings)
    assert_same(run(engine, PROMPTS, greedy(24)), baseline)
    assert engine.speculator.runner.key_caches[0].dtype.itemsize == 1
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
