"""Speculative decoding tests' shared prompts, configs, runs and checks (n-gram, sampled and draft-model)."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.outputs import CompletionOutput
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from tests.support.engines import run_to_end

# Repeated patterns, so the n-gram lookup finds matches in the prompt from the first decode on.
PROMPTS = [[5, 6, 7, 8] * 6, [10, 11, 12] * 5, list(range(20, 40)), [3, 9] * 7 + [4]]


def spec(k: int, lo: int = 1, hi: int = 3) -> dict:
    """An n-gram speculative_config drafting `k` tokens from suffixes of `lo`..`hi` tokens."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> dict[
    str, CompletionOutput
]:
    """All prompts at once; each request's final completion by id."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", None, p, prompt_token_ids=prompt)
    return {rid: out.outputs[0] for rid, out in run_to_end(engine).items()}


def assert_same(got: dict[str, CompletionOutput], want: dict[str, CompletionOutput]) -> None:
    """Each request's tokens, text, finish reason and cumulative logprob equal."""
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids, rid
        assert got[rid].text == out.text, rid
        assert got[rid].finish_reason == out.finish_reason, rid
        assert got[rid].cumulative_logprob == pytest.approx(out.cumulative_logprob, abs=1e-3), rid


def assert_speculated_and_all_free(engine: LLMEngine) -> None:
    """Drafts were made and some accepted, and every KV block came back."""
    stats = engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.num_free_blocks == stats.num_blocks


def all_outputs(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list]:
    """Every sequence of every request (n > 1 too): {request id: [completions]}."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", None, p, prompt_token_ids=prompt)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs
    return final
