"""Mixture of experts: routing and the reference against transformers' Mixtral / Qwen2-MoE modules, the CPU
kernel and the Triton kernel (interpreter) against the reference, and the block alignment the Triton GEMMs walk."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import kernels
from pagedserve.kernels.moe import cpu, reference
from pagedserve.kernels.moe import triton as moe_triton
from pagedserve.kernels.moe.align import align_block_size
from tests.support.kernel_checks import spy

HIDDEN, INTER = 32, 24


def assert_moe_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: to rounding; bf16: within 4% of the output's largest magnitude, since six bf16 roundings per
    expert (truncations under the interpreter) drift each sum by a few steps of its largest terms."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), atol=4e-2 * scale, rtol=0)


def make_experts(num_experts: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random stacked w13 [E, 2I, H] and w2 [E, H, I] of a scale that keeps activations near one."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=g) / INTER ** 0.5
    return w13.to(dtype), w2.to(dtype)


def make_batch(tokens: int, num_experts: int, top_k: int, renormalize: bool, dtype: torch.dtype,
               same_expert: int | None = None, seed: int = 1):
    """x, routing weights and ids for `tokens` rows; with `same_expert`, every token's first choice is that one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g)
    if same_expert is not None:
        logits[:, same_expert] += 100.0
    weights, ids = kernels.topk_routing(logits, top_k, renormalize)
    return x, weights, ids


# (tokens, experts, top_k, first choice forced): more experts than tokens, all tokens on one expert, top-1,
# and enough pairs for several row blocks per expert (and for the Triton launcher's larger block).
CASES = [(5, 8, 2, None), (3, 16, 2, None), (9, 8, 2, 3), (6, 4, 1, 0), (11, 6, 1, None), (40, 4, 2, None),
         (150, 4, 2, None)]


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_equals_transformers_mixtral_and_qwen2_moe_routers(renormalize):
    cfg = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=renormalize)
    router = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(13, HIDDEN)
    _, want_weights, want_ids = router(x)
    weights, ids = kernels.topk_routing(x @ router.weight.T, 2, renormalize)
    torch.testing.assert_close(weights, want_weights)
    assert torch.equal(ids, want_ids)
    if renormalize:
        mixtral = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2))
        mixtral.weight.data.copy_(router.weight.data)
        _, mixtral_weights, mixtral_ids = mixtral(x)
        torch.testing.assert_close(weights, mixtral_weights)
        assert torch.equal(ids, mixtral_ids)
    else:
        assert not torch.allclose(weights.sum(-1), torch.ones(13))


def test_reference_equals_transformers_mixtral_experts():
    cfg = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    w13, w2 = make_experts(8, torch.float32)
    experts.gate_up_proj.data.copy_(w13)
    experts.down_proj.data.copy_(w2)
    x, weights, ids = make_batch(10, 8, 2, True, torch.float32)
    with torch.no_grad():
        want = experts(x, ids, weights)
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, weights, ids), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "same_expert"), CASES)
def test_cpu_and_triton_equal_reference(tokens, num_experts, top_k, same_expert, dtype):
    w13, w2 = make_experts(num_experts, dtype)
    x, weights, ids = make_batch(tokens, num_experts, top_k, tokens % 2 == 1, dtype, same_expert)
    if same_expert is not None:
        assert (ids[:, 0] == same_expert).all()
    want = reference.fused_moe(x, w13, w2, weights, ids)
    for impl in (cpu, moe_triton):
        got = impl.fused_moe(x, w13, w2, weights, ids)
        assert_moe_close(got, want)


def test_weights_in_the_model_dtype_as_qwen_rounds_them():
    w13, w2 = make_experts(8, torch.bfloat16)
    x, weights, ids = make_batch(7, 8, 2, False, torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    for impl in (cpu, moe_triton):
        assert_moe_close(impl.fused_moe(x, w13, w2, weights, ids), want)


def test_no_tokens_gives_an_empty_output():
    w13, w2 = make_experts(4, torch.float32)
    x, weights, ids = make_batch(0, 4, 2, True, torch.float32)
    for impl in (cpu, moe_triton):
        assert impl.fused_moe(x, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_cpu_runs_two_gemms_per_expert_with_tokens_whatever_the_token_count(monkeypatch):
    w13, w2 = make_experts(16, torch.float32)
    x, weights, ids = make_batch(64, 16, 2, True, torch.float32, seed=3)
    calls = spy(monkeypatch, torch, "matmul")
    cpu.fused_moe(x, w13, w2, weights, ids)
    assert len(calls) == 2 * torch.unique(ids).numel()


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "block_m"), [(5, 8, 2, 4), (9, 3, 2, 16), (1, 64, 4, 16)])
def test_alignment_groups_every_pair_once_in_blocks_of_one_expert(tokens, num_experts, top_k, block_m):
    _, _, ids = make_batch(tokens, num_experts, top_k, True, torch.float32, same_expert=1 if tokens == 9 else None)
    align = align_block_size(ids, num_experts, block_m)
    pairs = tokens * top_k
    real = align.sorted_ids[align.sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    flat = ids.reshape(-1)
    for block, expert in enumerate(align.block_expert.tolist()):
        rows = align.sorted_ids[block * block_m:(block + 1) * block_m]
        rows = rows[rows < pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == expert).all()
            assert torch.equal(rows, rows.sort().values)  # stable: a token's pairs in token order
    used_blocks = int((align.block_expert >= 0).sum())
    assert used_blocks == sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))


def test_entry_dispatches_cpu_by_default_and_triton_when_forced(monkeypatch):
    w13, w2 = make_experts(4, torch.float32)
    x, weights, ids = make_batch(3, 4, 2, True, torch.float32)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    cpu_calls = spy(monkeypatch, cpu, "fused_moe")
    kernels.fused_moe(x, w13, w2, weights, ids)
    triton_calls = spy(monkeypatch, moe_triton, "fused_moe")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    kernels.fused_moe(x, w13, w2, weights, ids)
    assert len(cpu_calls) == 1 and len(triton_calls) == 1


def test_entry_refuses_mismatched_expert_weights():
    w13, w2 = make_experts(4, torch.float32)
    x, weights, ids = make_batch(3, 4, 2, True, torch.float32)
    with pytest.raises(AssertionError, match="w2 is"):
        kernels.fused_moe(x, w13, w2[:3], weights, ids)
    with pytest.raises(AssertionError, match="top_k 5"):
        kernels.topk_routing(torch.randn(3, 4), 5, True)
