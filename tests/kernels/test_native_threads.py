"""The native row kernels split their rows over torch's OpenMP team: above their size thresholds, any thread
count gives the same bits as one thread (each row is computed by one thread, in the same order)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.activation import cpu as activation
from pagedserve.kernels.native.split import openmp_available
from pagedserve.kernels.norm import cpu as norm
from pagedserve.kernels.rope import cpu as rope
from pagedserve.kernels.sampling import cpu as sampling
from tests.support.kernel_checks import needs_native

pytestmark = [needs_native, pytest.mark.skipif(not openmp_available(), reason="built without OpenMP")]


def _at_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _same_at_every_thread_count(fn) -> None:
    one = _at_threads(1, fn)
    for threads in (2, 3):
        other = _at_threads(threads, fn)
        for a, b in zip(one if isinstance(one, tuple) else (one,), other if isinstance(other, tuple) else (other,),
                        strict=True):
            assert torch.equal(a, b), f"{threads} threads differ from one"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_activation_rows_split_over_threads_equal_one_thread(dtype):
    x, residual, weight = torch.randn(301, 576).to(dtype), torch.randn(301, 576).to(dtype), torch.randn(576).to(dtype)
    _same_at_every_thread_count(lambda: norm.rms_norm(x, weight, 1e-5, residual))
    _same_at_every_thread_count(lambda: norm.rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(203, 2 * 768).to(dtype)
    _same_at_every_thread_count(lambda: activation.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_tokens_split_over_threads_equal_one_thread(dtype):
    tokens, q_heads, kv_heads, head_dim = 257, 9, 3, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 512, (tokens,))
    cos_sin = torch.randn(512, head_dim)
    slots = torch.randperm(320)[:tokens]

    def run():
        key_cache = torch.zeros(20, 16, kv_heads, head_dim, dtype=dtype)
        value_cache = torch.zeros_like(key_cache)
        q_out = rope.rotary_embedding_and_cache(positions, q, k, v, cos_sin, key_cache, value_cache, slots)
        return q_out, key_cache, value_cache

    _same_at_every_thread_count(run)


def test_sampling_rows_split_over_threads_equal_one_thread():
    logits = torch.randn(37, 4099) * 3
    logits[5, :100] = -float("inf")
    inv_temps, min_ps = torch.rand(37) + 0.5, torch.rand(37) * 0.1
    uniforms = torch.rand(37, dtype=torch.float64)
    _same_at_every_thread_count(lambda: sampling.sample_from_logits(logits, inv_temps, min_ps, uniforms))
    _same_at_every_thread_count(lambda: sampling.logsumexp(logits))
    wide = torch.randn(600, 1000).bfloat16()  # above the widening's threshold
    _same_at_every_thread_count(lambda: sampling.to_float32(wide))
