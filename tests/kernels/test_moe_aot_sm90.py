"""The fused-MoE GEMM kernels compile for the H100/H200 (sm_90) without a GPU, in bf16 at the decode and the
prefill row block, the gated w13 and the weighted w2 kernel: no register spills, shared memory within the limit."""

from __future__ import annotations

from tests.support.kernel_checks import compile_for_sm90

# Runs in a fresh interpreter: here the kernels were decorated for TRITON_INTERPRET and cannot compile.
_SCRIPT = """
import json, torch
from pagedserve.kernels.moe import reference, triton as moe_triton
from pagedserve.kernels.aot import compile_launch, record_launches

experts, hidden, inter = 8, 256, 128
w13 = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
w2 = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
with record_launches(moe_triton) as launches:
    for tokens in (1, 512):
        weights, ids = reference.topk_routing(torch.randn(tokens, experts), 2, True)
        moe_triton.fused_moe(torch.zeros(tokens, hidden, dtype=torch.bfloat16), w13, w2, weights, ids)
print(json.dumps([compile_launch(launch) for launch in launches]))
"""


def test_moe_gemm_kernels_compile_for_sm90_without_spills():
    configs = compile_for_sm90(_SCRIPT)
    assert [(c["constexprs"]["BLOCK_M"], c["constexprs"]["GATED"]) for c in configs] == [
        (16, True), (16, False), (64, True), (64, False)]
    for config in configs:
        assert config["stack_bytes"] == 0, config  # no register spills
        assert config["shared_bytes"] <= 232448, config  # 227 KB per block on sm_90
