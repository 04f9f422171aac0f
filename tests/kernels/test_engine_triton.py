"""The engine forced onto the Triton kernels (CPU interpreter) still produces transformers' greedy tokens."""

from __future__ import annotations

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.kernels.attention import triton as attention_triton

from .checks import spy

PROMPTS = [[5, 17, 33, 90, 41, 7, 250, 3, 64], [12, 8, 300, 77, 19, 45, 101, 6, 222, 13, 58, 91, 140, 2, 31]]
MAX_NEW_TOKENS = 6


def test_engine_on_triton_kernels_matches_transformers_greedy(tiny_llama_path, monkeypatch, hf_reference):
    launches = spy(monkeypatch, attention_triton, "paged_attention")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    # A small token budget chunks the longer prompt, so steps mix a prefill chunk with a decode.
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), dtype="float32", device="cpu", block_size=16,
                                       num_blocks=8, max_num_batched_tokens=10, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=ids)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert launches, "the Triton attention kernel never ran"
    for i, ids in enumerate(PROMPTS):
        assert final[f"r{i}"] == hf_reference.greedy(tiny_llama_path, ids, MAX_NEW_TOKENS)[0]
