"""SiLU-and-mul: the torch reference against transformers' activation, Triton and the native kernel against it."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.activation import cpu, reference
from pagedserve.kernels.activation import triton as activation_triton
from tests.support.kernel_checks import assert_native_matches_reference, needs_native, triton_tol

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_triton_equals_reference(dtype):
    x = torch.randn(4, 2 * 1100).to(dtype)  # two column tiles, the second partly masked
    out = activation_triton.silu_and_mul(x)
    assert out.shape == (4, 1100)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **triton_tol(dtype))


def test_silu_and_mul_reference_matches_transformers_mlp_activation():
    gate, up = torch.randn(3, 50), torch.randn(3, 50)
    # Strided halves may take another vectorised path in torch: one fp32 ulp of slack.
    torch.testing.assert_close(reference.silu_and_mul(torch.cat([gate, up], -1)),
                               torch.nn.functional.silu(gate) * up, atol=1e-7, rtol=3e-7)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_silu_and_mul_equals_reference(dtype):
    x = (torch.randn(29, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    assert_native_matches_reference(cpu.silu_and_mul(x), reference.silu_and_mul(x))


@needs_native
def test_cpu_silu_and_mul_of_an_unsupported_dtype_falls_back_to_the_reference():
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x))


def test_gelu_tanh_and_mul_reference_matches_transformers_gemma_activation():
    from transformers.activations import ACT2FN

    gate, up = torch.randn(3, 50) * 3, torch.randn(3, 50)
    torch.testing.assert_close(reference.gelu_tanh_and_mul(torch.cat([gate, up], -1)),
                               ACT2FN["gelu_pytorch_tanh"](gate) * up, atol=1e-7, rtol=3e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_triton_equals_reference(dtype):
    x = torch.randn(4, 2 * 1100) * 4  # large |gate| too, where tanh saturates
    x[0, :8] = torch.tensor([-30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0, 100.0])
    x = x.to(dtype)
    out = activation_triton.gelu_tanh_and_mul(x)
    assert out.shape == (4, 1100)
    # The kernel's sigmoid form keeps the tail (|value| ~1e-6 at gate ~ -5) that the reference's 1 + tanh rounds
    # to zero, so fp32 is held to 1e-5 absolute on outputs of order 10.
    tol = triton_tol(dtype) if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-6}
    torch.testing.assert_close(out, reference.gelu_tanh_and_mul(x), **tol)


def test_gelu_tanh_and_mul_dispatch_serves_the_cpu():
    from pagedserve import kernels

    x = torch.randn(5, 64)
    torch.testing.assert_close(kernels.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))
