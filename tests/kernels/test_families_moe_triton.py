"""The MoE families forced onto the Triton kernels (CPU interpreter): the experts run through the Triton
fused-MoE GEMMs and the greedy tokens still equal transformers'."""

from __future__ import annotations

import pytest
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.kernels.moe import triton as moe_triton

from pagedserve.testing import make_tiny_model

from .checks import spy

PROMPTS = [[5, 17, 33, 90, 41, 7, 250, 3, 64], [12, 8, 300, 77, 19, 45, 101, 6, 222, 13, 58]]
MAX_NEW_TOKENS = 4


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_family_on_triton_kernels_matches_transformers_greedy(arch, tmp_path, monkeypatch, hf_reference):
    path = make_tiny_model(tmp_path / arch, arch, seed=32, random_norms=True)
    launches = spy(monkeypatch, moe_triton, "fused_moe")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", block_size=16, num_blocks=8,
                                       max_num_batched_tokens=10, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=ids)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert launches, "the Triton fused-MoE kernel never ran"
    for i, ids in enumerate(PROMPTS):
        assert final[f"r{i}"] == hf_reference.greedy(path, ids, MAX_NEW_TOKENS)[0]
