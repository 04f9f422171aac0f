"""Qwen3 and Phi-3 forced onto the Triton kernels (CPU interpreter): the per-head q/k norms go through the
Triton RMSNorm, partial rotary through the Triton rotary on strided head slices, and the greedy tokens still
equal transformers'."""

from __future__ import annotations

import pytest

from pagedserve.kernels.norm import triton as norm_triton
from pagedserve.kernels.rope import triton as rope_triton
from pagedserve.testing import make_tiny_model
from tests.support.kernel_checks import greedy_on_triton, spy

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
    tokens = greedy_on_triton(monkeypatch, path, PROMPTS, MAX_NEW_TOKENS)
    assert norms and rotations, "the Triton norm and rotary kernels never ran"
    assert tokens == [hf_reference.greedy(path, ids, MAX_NEW_TOKENS)[0] for ids in PROMPTS]
