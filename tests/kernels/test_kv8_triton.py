"""The Triton kernels on an fp8 KV cache (issue 34), under the interpreter: writes byte for byte the reference's
(kv8.quantize), attention equal to the torch reference on the dequantized cache to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import kv8
from pagedserve.kernels.attention import reference
from pagedserve.kernels.attention import triton as attention_triton
from pagedserve.kernels.cache import reference as cache_reference
from pagedserve.kernels.cache import triton as cache_triton
from tests.support.kernel_checks import compile_for_sm90, spy
from tests.support.paged_attention import BF16_TOL, DECODES, FP32_TOL, MIXED, PagedBatch, make_batch

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
NAN_BYTE = 0x7F  # NaN in both formats


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, every midpoint between neighbours (the ties) and the fp32 values either
    side of it, subnormals, zeros of both signs, the largest value and beyond, infinities and NaN."""
    exact = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    exact = exact[exact.isfinite()].unique()
    mid = ((exact[1:].double() + exact[:-1].double()) / 2).float()  # exact in fp32: one more mantissa bit
    up, down = torch.nextafter(mid, torch.tensor(float("inf"))), torch.nextafter(mid, torch.tensor(float("-inf")))
    largest = torch.finfo(dtype).max
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, largest * 1.01, -largest * 1.5, 1e6, -1e6, float("inf"),
                            float("-inf"), float("nan")])
    return torch.cat([exact, mid, up, down, special])


def _fp8_batch(lens: list[tuple[int, int]], dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int,
               block_size: int, k_scale: float, v_scale: float, seed: int,
               query_dtype: torch.dtype = torch.float32) -> tuple[PagedBatch, PagedBatch]:
    """(fp8 batch, the same batch with its caches dequantized to fp32). In the fp8 batch, blocks no sequence owns
    hold NaN bytes and every table's padding column points at one: a kernel that reads past a sequence's context
    returns NaN (the batched reference gathers padding blocks, so its copy holds zeros there)."""
    batch = make_batch(lens, num_kv_heads, group, head_dim, block_size, seed=seed)
    # Keys spread over the format's range (a few saturate at e4m3's 448), values at a smaller scale.
    key_cache = kv8.quantize(batch.key_cache * 3.0, dtype, k_scale)
    value_cache = kv8.quantize(batch.value_cache, dtype, v_scale)
    owned = torch.zeros(key_cache.shape[0], dtype=torch.bool)
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        owned[batch.block_tables[s, : -(-seq_len // block_size)].long()] = True
    for cache in (key_cache, value_cache):
        cache.view(torch.uint8)[~owned] = NAN_BYTE
    batch.block_tables[:, -1] = int((~owned).nonzero()[0])
    query = batch.query.to(query_dtype)
    fp8 = PagedBatch(query, key_cache, value_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                     batch.scale)
    key, value = kv8.dequantize(key_cache, k_scale), kv8.dequantize(value_cache, v_scale)
    key[~owned], value[~owned] = 0.0, 0.0
    dequantized = PagedBatch(query.float(), key, value, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                             batch.scale)
    return fp8, dequantized


def _attention(batch: PagedBatch, k_scale: float, v_scale: float, **kwargs) -> torch.Tensor:
    return attention_triton.paged_attention(*batch.args(), k_scale=k_scale, v_scale=v_scale, **kwargs)


def _oracle(batch: PagedBatch, window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    return reference.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap)


# --- the write path ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-6])
def test_reshape_and_cache_quantizes_edge_values_to_the_reference_bytes(dtype, scale):
    # Ties round to even, subnormals, saturation at the largest finite value, infinities saturate, NaN stays NaN.
    values = _edge_values(dtype) * scale
    head_dim = 64
    num_tokens = -(-values.numel() // head_dim)
    key = torch.cat([values, torch.zeros(num_tokens * head_dim - values.numel())]).view(num_tokens, 1, head_dim)
    value = -key.flip(0)
    slots = torch.arange(num_tokens, dtype=torch.int64)
    caches = [torch.zeros(-(-num_tokens // 16), 16, 1, head_dim, dtype=dtype) for _ in range(4)]
    cache_triton.reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale=scale, v_scale=scale)
    cache_reference.reshape_and_cache(key, value, caches[2], caches[3], slots, k_scale=scale, v_scale=scale)
    for got, want in zip(caches[:2], caches[2:], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    stored = caches[0].view(torch.uint8).flatten()[: values.numel()]
    largest = int(torch.tensor(torch.finfo(dtype).max).to(dtype).view(torch.uint8))
    assert (stored == NAN_BYTE).any() and (stored == largest).any() and (stored == largest | 0x80).any()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("activation", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_fp8_writes_each_token_to_its_slot_and_skips_padding(dtype, activation):
    # K and V as strided views of one fused projection, as the model makes them; scales of both directions.
    num_kv_heads, head_dim = 2, 80
    fused = (torch.randn(5, 3 * num_kv_heads * head_dim, generator=torch.Generator().manual_seed(1)) * 4).to(activation)
    _, key, value = (t.view(5, num_kv_heads, head_dim) for t in fused.split(num_kv_heads * head_dim, dim=-1))
    slots = torch.tensor([17, -1, 95, 0, 40], dtype=torch.int64)
    caches = [torch.zeros(6, 16, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    cache_triton.reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale=0.05, v_scale=3.0)
    cache_reference.reshape_and_cache(key, value, caches[2], caches[3], slots, k_scale=0.05, v_scale=3.0)
    for got, want in zip(caches[:2], caches[2:], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    flat = caches[0].view(torch.uint8).view(-1, num_kv_heads * head_dim)
    assert flat[[17, 95, 0, 40]].any(dim=1).all()
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[17, 95, 0, 40]] = False
    assert not flat[untouched].any()


def test_copy_blocks_copies_fp8_bytes_unchanged():
    # NaN bytes included: a copy must not canonicalise them.
    caches = [torch.randint(0, 256, (6, 16, 2, 32), dtype=torch.uint8).view(torch.float8_e4m3fn) for _ in range(2)]
    caches[0].view(torch.uint8)[1, 0, 0, :4] = NAN_BYTE
    before = [c.view(torch.uint8).clone() for c in caches]
    cache_triton.copy_blocks([caches[0]], [caches[1]], [(1, 4), (5, 0)])
    for after, old in zip(caches, before, strict=True):
        after = after.view(torch.uint8)
        assert torch.equal(after[4], old[1]) and torch.equal(after[0], old[5])
        assert torch.equal(after[[1, 2, 3, 5]], old[[1, 2, 3, 5]])


def test_scales_on_a_cache_that_is_not_fp8_are_refused():
    key = torch.randn(2, 1, 16)
    cache = torch.zeros(2, 16, 1, 16)
    with pytest.raises(AssertionError, match="k_scale"):
        cache_triton.reshape_and_cache(key, key, cache, cache, torch.arange(2), k_scale=0.5)
    batch = make_batch(DECODES, 1, 2, 16, 16)
    with pytest.raises(AssertionError, match="k_scale"):
        attention_triton.paged_attention(*batch.args(), v_scale=2.0)


def _fused_rotary_inputs(activation: torch.dtype, seed: int):
    """Positions, query, strided key and value views of one projection, a cos/sin table and slots with padding."""
    from pagedserve.kernels.rope import compute_cos_sin_cache

    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 6, 6, 3, 80
    fused = (torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(activation)
    q, k, v = fused.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos_sin = compute_cos_sin_cache(head_dim, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    return (torch.tensor([0, 5, 63, 7, 1, 30]), q.view(num_tokens, num_q_heads, head_dim),
            k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim), cos_sin,
            torch.tensor([3, -1, 40, 17, 0, 63]))


@pytest.mark.parametrize("cache_dtype", [*FP8, pytest.param(None, id="activation-dtype")])
@pytest.mark.parametrize("activation", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_rotary_and_cache_writes_the_two_reference_ops_bytes(cache_dtype, activation):
    from pagedserve.kernels.rope import reference as rope_reference
    from pagedserve.kernels.rope import triton as rope_triton

    positions, query, key, value, cos_sin, slots = _fused_rotary_inputs(activation, seed=9)
    cache_dtype = cache_dtype or activation
    scales = {"k_scale": 0.03, "v_scale": 0.02} if kv8.is_fp8(torch.empty(0, dtype=cache_dtype)) else {}
    caches = [torch.zeros(4, 16, 3, 80, dtype=cache_dtype) for _ in range(4)]
    rotated = rope_triton.rotary_embedding_and_cache(positions, query, key, value, cos_sin, caches[0], caches[1],
                                                     slots, **scales)
    want_q, want_k = rope_triton.rotary_embedding(positions, query, key, cos_sin)
    cache_reference.reshape_and_cache(want_k, value, caches[2], caches[3], slots, **scales)
    assert torch.equal(rotated, want_q)  # the unfused Triton rotary's exact result
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))  # values: no rotation
    got, want = caches[0].view(torch.uint8), caches[2].view(torch.uint8)
    assert torch.equal(got, want)
    if activation == torch.bfloat16:
        return  # the interpreter truncates fp32 -> bf16 where torch and the GPU round: test_rope's bf16 tolerance
    # fp32 and fp16 (numpy rounds to nearest): the bytes of torch's rotary followed by the reference write.
    ref_q, ref_k = rope_reference.rotary_embedding(positions, query, key, cos_sin)
    torch_caches = [torch.zeros_like(caches[0]) for _ in range(2)]
    cache_reference.reshape_and_cache(ref_k, value, *torch_caches, slots, **scales)
    assert torch.equal(rotated, ref_q) and torch.equal(got, torch_caches[0].view(torch.uint8))


# --- the read path ----------------------------------------------------------------------------------------------

# (num_kv_heads, group, head_dim, block_size): GQA 1, 4 and 8, an odd head size, both block sizes.
SHAPES = [pytest.param(2, 1, 64, 16, id="gqa1-d64-bs16"), pytest.param(2, 4, 80, 32, id="gqa4-d80-bs32"),
          pytest.param(1, 8, 64, 16, id="gqa8-d64-bs16")]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"), SHAPES)
def test_triton_fp8_mixed_batch_equals_reference_on_the_dequantized_cache(dtype, num_kv_heads, group, head_dim,
                                                                           block_size):
    # Chunked prefill over a cached prefix, decodes (one at position 0), a fresh prompt, odd lengths.
    fp8, dequantized = _fp8_batch(MIXED, dtype, num_kv_heads, group, head_dim, block_size, 0.02, 0.3, seed=1)
    torch.testing.assert_close(_attention(fp8, 0.02, 0.3), _oracle(dequantized), **FP32_TOL)


@pytest.mark.parametrize("dtype", FP8)
def test_triton_fp8_long_prefill_chunk_on_large_tiles_equals_reference(dtype):
    fp8, dequantized = _fp8_batch([(260, 300), (1, 70)], dtype, 1, 4, 64, 16, 0.05, 0.5, seed=2)
    torch.testing.assert_close(_attention(fp8, 0.05, 0.5), _oracle(dequantized), **FP32_TOL)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_fp8_decode_with_and_without_splits_equals_reference(dtype, num_splits):
    fp8, dequantized = _fp8_batch(DECODES, dtype, 2, 4, 64, 16, 0.02, 0.3, seed=3)
    torch.testing.assert_close(_attention(fp8, 0.02, 0.3, num_splits=num_splits), _oracle(dequantized),
                               **FP32_TOL)


# (window, soft cap, lens, splits): each paired with one shape, the interpreter being slow.
WINDOW_CASES = [
    pytest.param(5, None, MIXED, None, id="w5-mixed"),
    pytest.param(None, 2.0, MIXED, None, id="cap-mixed"),
    pytest.param(16, 1.5, MIXED, None, id="w16-cap-mixed"),
    pytest.param(40, None, DECODES, 4, id="w40-split4"),
    pytest.param(7, 2.0, DECODES, 4, id="w7-cap-split4"),
]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize(("window", "soft_cap", "lens", "num_splits"), WINDOW_CASES)
def test_triton_fp8_windowed_and_capped_equals_reference(dtype, window, soft_cap, lens, num_splits):
    fp8, dequantized = _fp8_batch(lens, dtype, 1, 8, 64, 16, 0.03, 0.4, seed=4)
    fp8.query.mul_(3.0)
    out = _attention(fp8, 0.03, 0.4, sliding_window=window, logits_soft_cap=soft_cap, num_splits=num_splits)
    torch.testing.assert_close(out, _oracle(dequantized, window, soft_cap), **FP32_TOL)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_cache_under_a_16_bit_model_stays_within_its_rounding(dtype, query_dtype):
    fp8, dequantized = _fp8_batch(MIXED, dtype, 2, 4, 64, 16, 0.02, 0.3, seed=5, query_dtype=query_dtype)
    out = _attention(fp8, 0.02, 0.3)
    assert out.dtype == query_dtype
    torch.testing.assert_close(out.float(), _oracle(dequantized), **BF16_TOL)


@pytest.mark.parametrize("dtype", FP8)
def test_triton_fp8_write_then_read_stays_within_fp8_error_of_unquantized_attention(dtype):
    # The two kernels together: the scales' directions agree, and 8 bits cost only the format's rounding.
    batch = make_batch([(9, 30), (1, 21)], 2, 4, 64, 16, seed=6)
    num_tokens = int(batch.seq_lens.sum())
    key, value = torch.randn(2, num_tokens, 2, 64, generator=torch.Generator().manual_seed(7))
    slots = torch.cat([batch.block_tables[s, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
                       for s, n in enumerate(batch.seq_lens.tolist())])
    full = PagedBatch(batch.query, torch.zeros_like(batch.key_cache), torch.zeros_like(batch.value_cache),
                      batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, batch.scale)
    value = value / 8
    cache_reference.reshape_and_cache(key, value, full.key_cache, full.value_cache, slots)
    quant = PagedBatch(batch.query, full.key_cache.to(dtype), full.value_cache.to(dtype), batch.block_tables,
                       batch.cu_seqlens_q, batch.seq_lens, batch.scale)
    # Scales that map the largest |K| and |V| to about 100: no saturation in either format.
    cache_triton.reshape_and_cache(key, value, quant.key_cache, quant.value_cache, slots, k_scale=0.05,
                                   v_scale=0.006)
    out, want = _attention(quant, 0.05, 0.006), _oracle(full)
    # Half an ulp of relative error per K and V element (2**-4 for e4m3, 2**-3 for e5m2) moves these outputs by
    # about 5 % (8 %) of the largest; scales applied the wrong way round would not come near.
    error = (out - want).abs().max() / want.abs().max()
    assert 0 < error < (0.08 if dtype == torch.float8_e4m3fn else 0.15), error


# --- the entries route fp8 caches here --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP8)
def test_entries_send_fp8_caches_and_their_scales_to_the_triton_kernels(monkeypatch, dtype):
    from pagedserve import kernels
    from pagedserve.kernels.rope import compute_cos_sin_cache
    from pagedserve.kernels.rope import reference as rope_reference

    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    attention_calls = spy(monkeypatch, attention_triton, "paged_attention")
    write_calls = spy(monkeypatch, cache_triton, "reshape_and_cache")
    fp8, dequantized = _fp8_batch(MIXED, dtype, 1, 4, 32, 16, 0.02, 0.3, seed=8)
    out = kernels.paged_attention(*fp8.args(), sliding_window=20, k_scale=0.02, v_scale=0.3)
    assert len(attention_calls) == 1
    torch.testing.assert_close(out, _oracle(dequantized, 20), **FP32_TOL)

    # The fused rotary + write entry on Triton: the rotated key quantized into its slot with the reference's bytes.
    positions = torch.tensor([3, 0, 9])
    query, key, value = (torch.randn(3, h, 32, generator=torch.Generator().manual_seed(h)) for h in (4, 1, 1))
    cos_sin = compute_cos_sin_cache(32, 16, 10000.0, None, torch.float32, torch.device("cpu"))
    slots = torch.tensor([5, -1, 17])
    caches = [torch.zeros(2, 16, 1, 32, dtype=dtype) for _ in range(4)]
    rotated = kernels.rotary_embedding_and_cache(positions, query, key, value, cos_sin, caches[0], caches[1], slots,
                                                 k_scale=0.01, v_scale=0.02)
    assert len(write_calls) == 1
    want_q, want_k = rope_reference.rotary_embedding(positions, query, key, cos_sin)
    cache_reference.reshape_and_cache(want_k, value, caches[2], caches[3], slots, k_scale=0.01, v_scale=0.02)
    torch.testing.assert_close(rotated, want_q, **FP32_TOL)
    for got, want in zip(caches[:2], caches[2:], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# --- sm_90 --------------------------------------------------------------------------------------------------------

# Runs in a fresh interpreter (the kernels here were decorated for the interpreter and cannot compile).
_AOT_SCRIPT = """
import json, torch
from pagedserve.kernels.attention import triton as attention_triton
from pagedserve.kernels.cache import triton as cache_triton
from pagedserve.kernels.rope import triton as rope_triton
from pagedserve.kernels.aot import compile_launch, record_launches

def batch(lens, dtype, hq=32, hkv=8, d=128, bs=16):
    blocks = sum(-(-k // bs) for _, k in lens)
    cache = torch.zeros(blocks, bs, hkv, d, dtype=dtype)
    tables = torch.arange(blocks, dtype=torch.int32)[None].expand(len(lens), -1).contiguous()
    q_lens = torch.tensor([q for q, _ in lens])
    cu = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int()
    query = torch.zeros(int(q_lens.sum()), hq, d, dtype=torch.bfloat16)
    return (query, cache, cache, tables, cu, torch.tensor([k for _, k in lens], dtype=torch.int32), 0.1,
            int(q_lens.max()), max(k for _, k in lens))

scales = dict(k_scale=0.5, v_scale=0.25)
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
with record_launches(attention_triton, cache_triton, rope_triton) as launches:
    attention_triton.paged_attention(*batch([(1, 4096)] * 2, e4m3), **scales)  # decode tile
    attention_triton.paged_attention(*batch([(1, 4096)] * 2, e5m2), **scales, num_splits=4)  # split-K + reduce
    attention_triton.paged_attention(*batch([(512, 512), (1, 700)], e4m3), **scales)  # 128-row prefill tile
    attention_triton.paged_attention(*batch([(512, 8192), (1, 700)], e5m2, hq=16, d=256), **scales,
                                     sliding_window=4096, logits_soft_cap=50.0)  # Gemma 2's windowed, capped
    for dtype in (e4m3, e5m2):
        kv = torch.zeros(64, 8, 128, dtype=torch.bfloat16)
        cache = torch.zeros(8, 16, 8, 128, dtype=dtype)
        cache_triton.reshape_and_cache(kv, kv, cache, cache, torch.arange(64), **scales)
        q = torch.zeros(64, 32, 128, dtype=torch.bfloat16)
        rope_triton.rotary_embedding_and_cache(torch.arange(64), q, kv, kv, torch.zeros(64, 128), cache, cache,
                                               torch.arange(64), **scales)
cache_dtypes = [str(next(a.dtype for a in l.args if getattr(a, "dtype", None) in (e4m3, e5m2)))
                if l.fn.__name__ != "_split_reduce_kernel" else None for l in launches]
print(json.dumps([dict(compile_launch(l), cache=c) for l, c in zip(launches, cache_dtypes)]))
"""


@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90_without_spills():
    # fp8 pointers, the widening to bf16 before tl.dot and the integer quantizer: what the interpreter cannot check.
    configs = compile_for_sm90(_AOT_SCRIPT)
    assert [(c["kernel"], c["cache"]) for c in configs] == [
        ("_paged_attention_kernel", "torch.float8_e4m3fn"), ("_split_decode_kernel", "torch.float8_e5m2"),
        ("_split_reduce_kernel", None), ("_paged_attention_kernel", "torch.float8_e4m3fn"),
        ("_paged_attention_kernel", "torch.float8_e5m2"), ("_reshape_and_cache_kernel", "torch.float8_e4m3fn"),
        ("_rotary_cache_kernel", "torch.float8_e4m3fn"), ("_reshape_and_cache_kernel", "torch.float8_e5m2"),
        ("_rotary_cache_kernel", "torch.float8_e5m2")]
    assert [c["constexprs"]["DOT_DTYPE"] for c in configs if "DOT_DTYPE" in c["constexprs"]] == ["bf16"] * 4
    for config in configs:
        assert config["stack_bytes"] == 0, config  # no register spills
        assert config["shared_bytes"] <= 232448, config  # 227 KB per block on sm_90


@pytest.mark.slow
def test_the_gpu_checks_kv8_part_passes_as_its_dry_run(tmp_path):
    # bench/gpu_check.sh's kv8 part on tiny sizes under the interpreter: the wiring a GPU session will run.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGEDSERVE_KERNELS": "triton"}
    subprocess.run([sys.executable, "kernel_bench.py", "gpu-check", "--dry-run", "--parts", "kv8", "--out",
                    str(tmp_path)], check=True, env=env, cwd=bench, timeout=600, capture_output=True)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["kv8_all_correct"] is True and len(report["kv8_correctness"]) == 10
    assert [row["batch"] for row in report["kv8_decode"]] == [4]


# --- the engine ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_on_triton_kernels_with_an_fp8_cache_generates_the_reference_kernels_tokens(tmp_path, monkeypatch,
                                                                                          tiny_llama_path):
    # fp32 tiny Llama (GQA), checkpoint scales on one layer, a 10-token budget: prefill chunks ride with decodes.
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.kernels.rope import triton as rope_triton

    path = tmp_path / "scaled"
    shutil.copytree(tiny_llama_path, path)
    tensors = load_file(path / "model.safetensors")
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.05),
                    "model.layers.0.self_attn.v_scale": torch.tensor(0.02)})
    save_file(tensors, path / "model.safetensors")
    prompts = [[5, 9, 13, 200, 31, 7, 77, 101, 3 + 4, 250, 11, 12, 60, 61], [40, 41, 42], [300, 8, 9, 10, 11, 1 + 4]]

    def greedy(kernels_mode: str) -> tuple[list[list[int]], LLMEngine]:
        monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels_mode)
        engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", block_size=16, num_blocks=8,
                                           max_num_batched_tokens=10, max_num_seqs=4, kv_cache_dtype="fp8")
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        return [out.outputs[0].token_ids for out in outputs], engine

    want, reference_engine = greedy("torch")
    attention_calls = spy(monkeypatch, attention_triton, "paged_attention")
    # The rotated key's write: the fused kernel where the entry routes to it, else rotary then reshape_and_cache.
    fused_calls = spy(monkeypatch, rope_triton, "rotary_embedding_and_cache")
    write_calls = spy(monkeypatch, cache_triton, "reshape_and_cache")
    got, engine = greedy("triton")
    assert attention_calls and all(c[1].dtype == torch.float8_e4m3fn for c in attention_calls)
    assert all(c[5].dtype == torch.float8_e4m3fn for c in fused_calls) and all(
        c[2].dtype == torch.float8_e4m3fn for c in write_calls) and fused_calls + write_calls
    assert got == want
    for ours, theirs in zip(engine.runner.key_caches + engine.runner.value_caches,
                            reference_engine.runner.key_caches + reference_engine.runner.value_caches, strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
