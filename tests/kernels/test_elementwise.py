"""Rotary embedding, RMSNorm and SiLU-and-mul: torch references against transformers, Triton against them."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import elementwise_triton, reference
from pagedserve.kernels.rope_cache import compute_cos_sin_cache
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

# The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one bf16 step of slack.
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    return BF16_TOL if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_reference_matches_transformers_neox_rotation(dtype):
    head_dim, positions = 64, torch.tensor([0, 7, 1000, 3])
    cache = compute_cos_sin_cache(head_dim, 1024, 10000.0, None, dtype)
    q, k = torch.randn(4, 4, head_dim).to(dtype), torch.randn(4, 2, head_dim).to(dtype)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    # transformers' layout: [batch, heads, tokens, D] with cos/sin [batch, tokens, D].
    hf_q, hf_k = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
    ours_q, ours_k = reference.rotary_embedding(positions, q, k, cache)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotary_triton_equals_reference(dtype, head_dim):
    cache = compute_cos_sin_cache(head_dim, 256, 500000.0, None, dtype)
    fused = torch.randn(6, 7 * head_dim).to(dtype)  # q (5 heads) and k (2 heads) as strided views
    q = fused[:, : 5 * head_dim].view(6, 5, head_dim)
    k = fused[:, 5 * head_dim :].view(6, 2, head_dim)
    positions = torch.tensor([0, 1, 2, 255, 31, 100])
    out_q, out_k = elementwise_triton.rotary_embedding(positions, q, k, cache)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(out_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **_tol(dtype))


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
    torch.testing.assert_close(elementwise_triton.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               **_tol(dtype))
    out, summed = elementwise_triton.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_summed = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(summed, ref_summed, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_triton_equals_reference(dtype):
    x = torch.randn(4, 2 * 1100).to(dtype)  # two column tiles, the second partly masked
    out = elementwise_triton.silu_and_mul(x)
    assert out.shape == (4, 1100)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **_tol(dtype))


def test_silu_and_mul_reference_matches_transformers_mlp_activation():
    gate, up = torch.randn(3, 50), torch.randn(3, 50)
    # Strided halves may take another vectorised path in torch: one fp32 ulp of slack.
    torch.testing.assert_close(reference.silu_and_mul(torch.cat([gate, up], -1)),
                               torch.nn.functional.silu(gate) * up, atol=1e-7, rtol=3e-7)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"type": "linear", "factor": 4.0}],
                         ids=["none", "llama3", "linear-legacy-key"])
def test_cos_sin_cache_equals_transformers_rotary_embedding(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=500000.0,
                         rope_scaling=scaling, max_position_embeddings=512)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 512, 256), positions)
    cache = compute_cos_sin_cache(64, 512, 500000.0, scaling, torch.float32)
    assert torch.equal(cache[:, :32], cos[0, :, :32]) and torch.equal(cache[:, 32:], sin[0, :, :32])


def test_llama3_scaling_changes_low_frequencies_only():
    plain = compute_cos_sin_cache(64, 512, 500000.0, None, torch.float32)
    scaled = compute_cos_sin_cache(64, 512, 500000.0, LLAMA3, torch.float32)
    # Columns: cos of pairs 0..31, then their sines; pair 0 is the highest frequency.
    assert torch.equal(plain[:, 0], scaled[:, 0]) and torch.equal(plain[:, 32], scaled[:, 32])
    assert not torch.allclose(plain[:, 63], scaled[:, 63])


@pytest.mark.parametrize(("scaling", "field"), [({"rope_type": "yarn", "factor": 2.0}, "rope_type"),
                                                ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
                                                ({"rope_type": "linear"}, "factor")])
def test_cos_sin_cache_refuses_unsupported_scaling_naming_the_field(scaling, field):
    with pytest.raises(ValueError, match=f"rope_scaling.{field}"):
        compute_cos_sin_cache(64, 16, 10000.0, scaling, torch.float32)
