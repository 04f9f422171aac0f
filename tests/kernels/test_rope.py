"""Rotary embedding and its cos/sin table: the references against transformers, Triton (interpreter) and the
native kernels against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedserve.kernels.cache import reference as cache_reference
from pagedserve.kernels.rope import compute_cos_sin_cache, cpu, reference
from pagedserve.kernels.rope import triton as rope_triton
from tests.support.kernel_checks import assert_native_matches_reference, needs_native, triton_tol

DTYPES = [torch.float32, torch.bfloat16]


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
    out_q, out_k = rope_triton.rotary_embedding(positions, q, k, cache)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(out_q, ref_q, **triton_tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **triton_tol(dtype))


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


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_rotary_on_a_qkv_split_equals_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    num_tokens, hq, hkv, d = 23, 9, 3, 64
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided rows, as the model passes them
    q, k = q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d)
    table = compute_cos_sin_cache(d, 4096, 10000.0, None, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    got_q, got_k = cpu.rotary_embedding(positions, q, k, table)
    want_q, want_k = reference.rotary_embedding(positions, q, k, table)
    assert_native_matches_reference(got_q, want_q)
    assert_native_matches_reference(got_k, want_k)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_rotary_and_cache_writes_the_same_cache_as_the_two_reference_ops(dtype):
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
    got_q = cpu.rotary_embedding_and_cache(positions, q, k, v, table, caches[0], caches[1], slots)
    want_q, want_k = reference.rotary_embedding(positions, q, k, table)
    cache_reference.reshape_and_cache(want_k, v, caches[2], caches[3], slots)
    assert_native_matches_reference(got_q, want_q)
    assert_native_matches_reference(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
