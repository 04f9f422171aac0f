"""Greedy generation under chunked prefill, preemption and prefix-cache hits equals transformers, alone."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.engines import cpu_engine
from tests.support.parity import assert_staggered_batch_matches_transformers, parity_prompts

MODELS = [
    "tiny_llama_path",
    "tiny_qwen2_path",
    "tiny_tied_path",
    "tiny_llama3_rope_path",
    "tiny_linear_rope_path",
]


@pytest.mark.parametrize("model_fixture", MODELS)
def test_staggered_batch_matches_transformers_greedy_per_prompt(model_fixture, request, hf_reference):
    assert_staggered_batch_matches_transformers(request.getfixturevalue(model_fixture), hf_reference)


def test_sharded_mistral_checkpoint_matches_transformers(tiny_mistral_path, hf_reference):
    engine = cpu_engine(tiny_mistral_path, num_blocks=16)
    prompt = parity_prompts(engine.vocab_size)[4]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_reference.greedy(tiny_mistral_path, prompt, 6)[0]


def test_prompt_logprobs_match_transformers(tiny_qwen2_path, hf_reference):
    engine = cpu_engine(tiny_qwen2_path, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    prompt = parity_prompts(engine.vocab_size)[5]
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
    prompt = parity_prompts(engine.vocab_size)[6]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    got = [entry[tok] for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert got == pytest.approx(hf_reference.prompt_logprobs(tiny_llama_path, prompt), abs=0.1)
