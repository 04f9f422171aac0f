"""Qwen3 and Phi-3 forced onto the Triton kernels (CPU interpreter): the per-head q/k norms go through the
Triton RMSNorm, partial rotary through the Triton rotary on strided head slices, and the greedy tokens still
equal transformers'."""

from __future__ import annotations

import pytest
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.kernels.norm import triton as norm_triton
from pagedserve.kernels.rope import triton as rope_triton

from pagedserve.testing import make_tiny_model

from .checks import spy

PROMPTS = [[5, 17, 33, 90, 41, 7, 250, 3, 64], [12, 8, 300, 77, 19, 45, 101, 6, 222, 13, 58]]
MAX_NEW_TOKENS = 4
PARTIAL_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
                    "long_factor": [4.0] * 6, "original_max_position_embeddings": 4}
MODELS = {
    "qwen3": {"arch": "qwen3"},
    "phi3": {"arch": "phi3", "rope_scaling": PARTIAL_LONGROPE, "max_position_embeddings": 64,
             "config_extras": {"original_max_position_embeddings": 4, "partial_rotary_factor": 0.75}},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_family_on_triton_kernels_matches_transformers_greedy(name, tmp_path, monkeypatch, hf_reference):
    path = make_tiny_model(tmp_path / name, seed=31, random_norms=True, **MODELS[name])
    norms = spy(monkeypatch, norm_triton, "rms_norm")
    rotations = spy(monkeypatch, rope_triton, "rotary_embedding")
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
    assert norms and rotations, "the Triton norm and rotary kernels never ran"
    for i, ids in enumerate(PROMPTS):
        assert final[f"r{i}"] == hf_reference.greedy(path, ids, MAX_NEW_TOKENS)[0]
