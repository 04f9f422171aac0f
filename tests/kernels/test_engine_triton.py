"""The engine forced onto the Triton kernels (CPU interpreter) still produces transformers' greedy tokens."""

from __future__ import annotations

from pagedserve.kernels.attention import triton as attention_triton
from tests.support.kernel_checks import greedy_on_triton, spy

PROMPTS = [[5, 17, 33, 90, 41, 7, 250, 3, 64], [12, 8, 300, 77, 19, 45, 101, 6, 222, 13, 58, 91, 140, 2, 31]]
MAX_NEW_TOKENS = 6


def test_engine_on_triton_kernels_matches_transformers_greedy(tiny_llama_path, monkeypatch, hf_reference):
    launches = spy(monkeypatch, attention_triton, "paged_attention")
    tokens = greedy_on_triton(monkeypatch, tiny_llama_path, PROMPTS, MAX_NEW_TOKENS)
    assert launches, "the Triton attention kernel never ran"
    assert tokens == [hf_reference.greedy(tiny_llama_path, ids, MAX_NEW_TOKENS)[0] for ids in PROMPTS]
