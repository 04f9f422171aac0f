"""The dispatcher: the torch reference on CPU tensors, Triton when forced, a clear error on a bad setting."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import elementwise_triton, ops, reference


def test_cpu_tensors_use_the_torch_reference_by_default(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    assert ops.kernel_backend(torch.zeros(1)) == "torch"


def test_forcing_triton_runs_the_triton_kernel_on_cpu_under_the_interpreter(monkeypatch):
    calls = []
    real = elementwise_triton.silu_and_mul
    monkeypatch.setattr(elementwise_triton, "silu_and_mul", lambda x: calls.append(x) or real(x))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    x = torch.randn(3, 64)
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
    assert len(calls) == 1


def test_forcing_torch_never_touches_triton(monkeypatch):
    monkeypatch.setattr(elementwise_triton, "rms_norm", lambda *a: pytest.fail("triton kernel called"))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    x, w = torch.randn(2, 8), torch.ones(8)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_unknown_kernel_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGEDSERVE_KERNELS"):
        ops.silu_and_mul(torch.randn(1, 4))
