"""RMSNorm: the torch reference against transformers, Triton (interpreter) and the native kernel against it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.kernels.norm import cpu, reference
from pagedserve.kernels.norm import triton as norm_triton
from tests.support.kernel_checks import assert_native_matches_reference, needs_native, triton_tol

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_matches_transformers(dtype):
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x, residual = torch.randn(3, 96).to(dtype), torch.randn(3, 96).to(dtype)
    assert torch.equal(reference.rms_norm(x, norm.weight.data, 1e-5), norm(x))
    out, summed = reference.rms_norm(x, norm.weight.data, 1e-5, residual)
    assert torch.equal(summed, x + residual) and torch.equal(out, norm(x + residual))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_triton_with_and_without_residual_equals_reference(dtype):
    hidden = 200  # not a power of two: the row tile is masked
    x, residual = torch.randn(5, hidden).to(dtype), torch.randn(5, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    torch.testing.assert_close(norm_triton.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               **triton_tol(dtype))
    out, summed = norm_triton.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_summed = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, **triton_tol(dtype))
    torch.testing.assert_close(summed, ref_summed, **triton_tol(dtype))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rms_norm_equals_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype) + 0.5
    residual = torch.randn(37, 576, generator=gen).to(dtype) if with_residual else None
    got = cpu.rms_norm(x, weight, 1e-5, residual)
    want = reference.rms_norm(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the residual sum is one rounded add either way
        assert_native_matches_reference(got[0], want[0])
    else:
        assert_native_matches_reference(got, want)


@needs_native
def test_cpu_rms_norm_of_an_unsupported_dtype_falls_back_to_the_reference():
    x, w = torch.randn(4, 16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
