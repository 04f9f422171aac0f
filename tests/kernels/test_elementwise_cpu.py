"""The native fused CPU element-wise kernels against the torch reference they replace."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import cpu_native, elementwise_cpu, ops, reference
from pagedserve.kernels.rope_cache import compute_cos_sin_cache

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C++ compiler for the native kernels")
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: to rounding of a reordered sum; bf16: at most one bf16 ulp apart, and nearly all bit-equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=2 ** -7)
    assert (actual != expected).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype) + 0.5
    residual = torch.randn(37, 576, generator=gen).to(dtype) if with_residual else None
    got = elementwise_cpu.rms_norm(x, weight, 1e-5, residual)
    want = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the residual sum is one rounded add either way
        assert_matches_reference(got[0], want[0])
    else:
        assert_matches_reference(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_reference(dtype):
    x = (torch.randn(29, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    assert_matches_reference(elementwise_cpu.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_a_qkv_split_equals_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    num_tokens, hq, hkv, d = 23, 9, 3, 64
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided rows, as the model passes them
    q, k = q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d)
    table = compute_cos_sin_cache(d, 4096, 10000.0, None, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    got_q, got_k = elementwise_cpu.rotary_embedding(positions, q, k, table)
    want_q, want_k = reference.rotary_embedding(positions, q, k, table)
    assert_matches_reference(got_q, want_q)
    assert_matches_reference(got_k, want_k)


def test_cpu_tensors_in_auto_mode_use_the_native_ops(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    calls = []
    real = cpu_native.silu_and_mul
    monkeypatch.setattr(cpu_native, "silu_and_mul", lambda x: calls.append(x) or real(x))
    x = torch.randn(3, 8)
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
    assert len(calls) == 1


def test_unsupported_dtypes_fall_back_to_the_reference():
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(elementwise_cpu.silu_and_mul(x), reference.silu_and_mul(x))
    w = torch.ones(16, dtype=torch.float64)
    torch.testing.assert_close(elementwise_cpu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_logits_widen_from_bf16_exactly(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    x = (torch.randn(5, 1000) * 30).to(torch.bfloat16)
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    got = ops.to_float32(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float(), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_writes_the_same_cache_as_the_two_reference_ops(dtype):
    gen = torch.Generator().manual_seed(3)
    num_tokens, hq, hkv, d, block_size = 11, 6, 2, 32, 4
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)
    table = compute_cos_sin_cache(d, 256, 10000.0, None, dtype)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen)
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[4] = -1  # a padding token writes nothing
    caches = [torch.zeros(6, block_size, hkv, d, dtype=dtype) for _ in range(4)]
    got_q = elementwise_cpu.rotary_embedding_and_cache(positions, q, k, v, table, caches[0], caches[1], slots)
    want_q, want_k = reference.rotary_embedding(positions, q, k, table)
    reference.reshape_and_cache(want_k, v, caches[2], caches[3], slots)
    assert_matches_reference(got_q, want_q)
    assert_matches_reference(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
