"""Greedy generation under chunked prefill, preemption and prefix-cache hits equals transformers, alone."""

from __future__ import annotations

import random

import pytest
import torch
from pagedserve.backend.core.sampling_params import SamplingParams

from tests.support.engines import cpu_engine

PROMPT_LENGTHS = [5, 9, 14, 22, 31, 40, 52, 70]
SUBMIT_AT_STEP = [0, 0, 1, 2, 3, 5, 8, 12]
SHARED_PREFIX = 20  # prompts 3.. start with the same 20 tokens: 5 full blocks of 4
MAX_NEW_TOKENS = 10
MODELS = [
    "tiny_llama_path",
    "tiny_qwen2_path",
    "tiny_tied_path",
    "tiny_llama3_rope_path",
    "tiny_linear_rope_path",
]


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(SHARED_PREFIX)]
    prompts = []
    for i, length in enumerate(PROMPT_LENGTHS):
        head = prefix if i >= 3 else []
        prompts.append(head + [rng.randrange(3, vocab_size) for _ in range(length - len(head))])
    return prompts


@pytest.mark.parametrize("model_fixture", MODELS)
def test_staggered_batch_matches_transformers_greedy_per_prompt(model_fixture, request, hf_reference):
    path = request.getfixturevalue(model_fixture)
    engine = cpu_engine(path, block_size=4, num_blocks=24, max_num_batched_tokens=8, max_num_seqs=8)
    prompts = _prompts(engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    final = {}
    step = 0
    while len(final) < len(prompts):
        for i, at in enumerate(SUBMIT_AT_STEP):
            if at == step:
                engine.add_request(f"r{i}", None, params, prompt_token_ids=prompts[i])
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1

    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the pool should be small enough to force preemption"
    assert stats.prefix_cache_hits > 0, "later prompts should reuse the shared prefix blocks"
    assert stats.kv_cache_usage == 0.0
    for i, prompt in enumerate(prompts):
        completion = final[f"r{i}"].outputs[0]
        ref_tokens, ref_logprobs = hf_reference.greedy(path, prompt, MAX_NEW_TOKENS)
        assert completion.token_ids == ref_tokens, f"prompt {i} (length {len(prompt)})"
        assert completion.finish_reason == "length"
        got = [lp[tok] for lp, tok in zip(completion.logprobs, completion.token_ids, strict=True)]
        assert got == pytest.approx(ref_logprobs, abs=1e-4)


def test_sharded_mistral_checkpoint_matches_transformers(tiny_mistral_path, hf_reference):
    engine = cpu_engine(tiny_mistral_path, num_blocks=16)
    prompt = _prompts(engine.vocab_size)[4]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_reference.greedy(tiny_mistral_path, prompt, 6)[0]


def test_prompt_logprobs_match_transformers(tiny_qwen2_path, hf_reference):
    engine = cpu_engine(tiny_qwen2_path, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    prompt = _prompts(engine.vocab_size)[5]
    # A first request caches the prefix; prompt logprobs must still cover every position.
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    got = [entry[tok] for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert got == pytest.approx(hf_reference.prompt_logprobs(tiny_qwen2_path, prompt), abs=1e-4)
    assert all(2 <= len(entry) <= 3 for entry in out.prompt_logprobs[1:])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_prompt_logprobs_stay_close_to_fp32_transformers(tiny_llama_path, hf_reference, dtype):
    engine = cpu_engine(tiny_llama_path, dtype=dtype, block_size=4, num_blocks=32, max_num_batched_tokens=16)
    assert engine.runner.key_caches[0].dtype == getattr(torch, dtype)
    prompt = _prompts(engine.vocab_size)[6]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    got = [entry[tok] for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert got == pytest.approx(hf_reference.prompt_logprobs(tiny_llama_path, prompt), abs=0.1)
