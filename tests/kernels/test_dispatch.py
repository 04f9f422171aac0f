"""The dispatcher: which backend serves a tensor, that the chosen one runs, and a clear error on a bad setting."""

from __future__ import annotations

import os
import types

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import dispatch, native
from pagedserve.kernels.activation import cpu as activation_cpu
from pagedserve.kernels.activation import reference as activation_reference
from pagedserve.kernels.activation import triton as activation_triton
from pagedserve.kernels.attention import cpu as attention_cpu
from pagedserve.kernels.attention import reference as attention_reference
from pagedserve.kernels.cache import reference as cache_reference
from pagedserve.kernels.dispatch import Backend
from pagedserve.kernels.norm import reference as norm_reference
from pagedserve.kernels.norm import triton as norm_triton
from pagedserve.kernels.rope import cpu as rope_cpu
from pagedserve.kernels.rope import reference as rope_reference
from pagedserve.kernels.sampling import cpu as sampling_cpu
from tests.support.kernel_checks import needs_native, spy
from tests.support.paged_attention import DECODES, FP32_TOL, MIXED, make_batch, per_sequence_attention

CUDA_TENSOR = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"))  # all backend_for reads


def test_cpu_tensors_take_the_cpu_kernels_by_default(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    assert dispatch.backend_for(torch.zeros(1)) is Backend.CPU


def test_the_kernel_switches_follow_the_environment_at_run_time(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    assert dispatch.backend_for(torch.zeros(1)) is Backend.TORCH
    monkeypatch.delenv("PAGEDSERVE_KERNELS")
    assert dispatch.backend_for(torch.zeros(1)) is Backend.CPU
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "Off")
    assert not native.enabled() and native.load() is None
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "1")
    assert native.enabled()
    # os.environ replaced by another mapping (as some launchers do): the new one is read.
    monkeypatch.setattr(os, "environ", {**os.environ, "PAGEDSERVE_KERNELS": "torch"})
    assert dispatch.backend_for(torch.zeros(1)) is Backend.TORCH


def test_cuda_tensors_take_triton_and_fall_back_to_torch_without_it(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_has_triton", lambda: True)
    assert dispatch.backend_for(CUDA_TENSOR) is Backend.TRITON
    monkeypatch.setattr(dispatch, "_has_triton", lambda: False)
    assert dispatch.backend_for(CUDA_TENSOR) is Backend.TORCH


def test_forcing_triton_without_triton_installed_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    monkeypatch.setattr(dispatch, "_has_triton", lambda: False)
    with pytest.raises(RuntimeError, match="triton package is not installed"):
        dispatch.backend_for(torch.zeros(1))


def test_forcing_triton_runs_the_triton_kernel_on_cpu_under_the_interpreter(monkeypatch):
    calls = spy(monkeypatch, activation_triton, "silu_and_mul")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    x = torch.randn(3, 64)
    torch.testing.assert_close(kernels.silu_and_mul(x), activation_reference.silu_and_mul(x))
    assert len(calls) == 1


def test_forcing_torch_never_touches_triton(monkeypatch):
    monkeypatch.setattr(norm_triton, "rms_norm", lambda *a: pytest.fail("triton kernel called"))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    x, w = torch.randn(2, 8), torch.ones(8)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), norm_reference.rms_norm(x, w, 1e-6))


def test_unknown_kernel_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGEDSERVE_KERNELS"):
        kernels.silu_and_mul(torch.randn(1, 4))


def test_cpu_tensors_in_auto_mode_take_the_cpu_attention(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    calls = spy(monkeypatch, attention_cpu, "paged_attention")
    batch = make_batch(MIXED, 2, 2, 64, 16)
    torch.testing.assert_close(kernels.paged_attention(*batch.args()), per_sequence_attention(batch), **FP32_TOL)
    assert len(calls) == 1


def test_forcing_torch_keeps_the_pure_reference(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    monkeypatch.setattr(attention_cpu, "paged_attention", lambda *a: pytest.fail("cpu attention called"))
    batch = make_batch(DECODES, 2, 2, 64, 16)
    torch.testing.assert_close(kernels.paged_attention(*batch.args()), attention_reference.paged_attention(*batch.args()))


@needs_native
def test_cpu_tensors_in_auto_mode_use_the_native_ops(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    calls = spy(monkeypatch, activation_cpu, "_silu_and_mul_kernel")
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernels.silu_and_mul(x), activation_reference.silu_and_mul(x))
    assert len(calls) == 1


def _rotary_and_cache_args(dtype: torch.dtype = torch.float32) -> tuple:
    q, k, v = torch.randn(5, 4, 16).to(dtype), torch.randn(5, 2, 16).to(dtype), torch.randn(5, 2, 16).to(dtype)
    caches = torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)
    table = kernels.compute_cos_sin_cache(16, 32, 10000.0, None, dtype)
    return torch.arange(5), q, k, v, table, *caches, torch.tensor([3, 0, -1, 9, 14])


@needs_native
def test_rotary_and_cache_is_one_native_pass_on_cpu_tensors_in_auto_mode(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    calls = spy(monkeypatch, rope_cpu, "_rotary_and_cache_kernel")
    kernels.rotary_embedding_and_cache(*_rotary_and_cache_args())
    assert len(calls) == 1


def test_forcing_torch_runs_rotary_and_cache_as_the_two_reference_ops(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    monkeypatch.setattr(rope_cpu, "rotary_embedding_and_cache", lambda *a: pytest.fail("native fused op called"))
    positions, q, k, v, table, key_cache, value_cache, slots = _rotary_and_cache_args()
    query = kernels.rotary_embedding_and_cache(positions, q, k, v, table, key_cache, value_cache, slots)
    want_q, want_k = rope_reference.rotary_embedding(positions, q, k, table)
    want_key_cache, want_value_cache = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    cache_reference.reshape_and_cache(want_k, v, want_key_cache, want_value_cache, slots)
    assert torch.equal(query, want_q)
    assert torch.equal(key_cache, want_key_cache) and torch.equal(value_cache, want_value_cache)


def test_sampling_has_no_triton_kernel_so_forcing_triton_runs_the_reference(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    monkeypatch.setattr(sampling_cpu, "logsumexp", lambda *a: pytest.fail("cpu sampling called"))
    logits = torch.randn(3, 50)
    torch.testing.assert_close(kernels.logsumexp(logits), torch.logsumexp(logits, dim=-1))
