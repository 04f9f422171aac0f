"""The MoE families forced onto the Triton kernels (CPU interpreter): the experts run through the Triton
fused-MoE GEMMs and the greedy tokens still equal transformers'."""

from __future__ import annotations

import pytest

from pagedserve.kernels.moe import triton as moe_triton
from pagedserve.testing import make_tiny_model
from tests.support.kernel_checks import greedy_on_triton, spy

PROMPTS = [[5, 17, 33, 90, 41, 7, 250, 3, 64], [12, 8, 300, 77, 19, 45, 101, 6, 222, 13, 58]]
MAX_NEW_TOKENS = 4


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_family_on_triton_kernels_matches_transformers_greedy(arch, tmp_path, monkeypatch, hf_reference):
    path = make_tiny_model(tmp_path / arch, arch, seed=32, random_norms=True)
    launches = spy(monkeypatch, moe_triton, "fused_moe")
    tokens = greedy_on_triton(monkeypatch, path, PROMPTS, MAX_NEW_TOKENS)
    assert launches, "the Triton fused-MoE kernel never ran"
    assert tokens == [hf_reference.greedy(path, ids, MAX_NEW_TOKENS)[0] for ids in PROMPTS]
