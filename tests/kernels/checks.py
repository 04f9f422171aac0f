"""Tolerances and markers shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import native

needs_native = pytest.mark.skipif(native.load() is None, reason="no C++ compiler for the native kernels")
# The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one bf16 step of slack.
TRITON_BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}


def triton_tol(dtype: torch.dtype) -> dict:
    """How close an element-wise Triton kernel under the interpreter stays to its torch reference."""
    return TRITON_BF16_TOL if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}


def assert_native_matches_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: to rounding of a reordered sum; bf16: at most one bf16 ulp apart, and nearly all bit-equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=2 ** -7)
    assert (actual != expected).float().mean() < 0.02


def spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[tuple]:
    """Replace owner.name by a wrapper that records each call's arguments and forwards it; returns the record."""
    calls: list[tuple] = []
    real = getattr(owner, name)

    def recording(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls
