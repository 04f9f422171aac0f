"""The staggered-batch parity check every family's test runs: greedy requests arriving over several steps, under
chunked prefill, a pool that forces preemption and a shared prefix that hits the cache, each equal to
transformers' generate for the prompt alone (tokens, and fp32 logprobs within 1e-4)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.engines import cpu_engine, greedy
from tests.support.oracle import HFReference

PROMPT_LENGTHS = [5, 9, 14, 22, 31, 40, 52, 70]
SUBMIT_AT_STEP = [0, 0, 1, 2, 3, 5, 8, 12]
SHARED_PREFIX = 20  # prompts 3.. start with the same 20 tokens: 5 full blocks of 4
MAX_NEW_TOKENS = 10


def parity_prompts(vocab_size: int) -> list[list[int]]:
    """PROMPT_LENGTHS random prompts; those from the fourth on share a SHARED_PREFIX-token head."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(SHARED_PREFIX)]
    prompts = []
    for i, length in enumerate(PROMPT_LENGTHS):
        head = prefix if i >= 3 else []
        prompts.append(head + [rng.randrange(3, vocab_size) for _ in range(length - len(head))])
    return prompts


def assert_staggered_batch_matches_transformers(path: Path, hf_reference: HFReference) -> None:
    """Run the staggered batch on a 24-block pool of 4-token blocks with an 8-token step budget and compare."""
    engine = cpu_engine(path, block_size=4, num_blocks=24, max_num_batched_tokens=8, max_num_seqs=8)
    prompts = parity_prompts(engine.vocab_size)
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


def assert_served_file_matches_transformers(path: Path, twin: Path, hf_reference: HFReference, seed: int) -> None:
    """Six random prompts through an engine on `path` (a quantized file served as stored): greedy tokens and
    every prompt position's logprob equal transformers' on `twin` (its dequantized twin). The logprobs matter:
    tiny tied models mostly repeat a token, so greedy alone says little."""
    engine = cpu_engine(path, num_blocks=64, block_size=4)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(5, 24))] for _ in range(6)]
    outputs = [out.outputs[0].token_ids for out in engine.generate(prompts, greedy(10))]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_reference.greedy(twin, prompt, 10)[0], prompt
    scored = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, out in zip(prompts, scored, strict=True):
        got = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        assert got == pytest.approx(hf_reference.prompt_logprobs(twin, prompt), rel=2e-5, abs=1e-4)
