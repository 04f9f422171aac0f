"""The CPU kernels on an 8-bit (fp8) KV cache: the native decode kernel (AVX-512 and portable loops), the native
prefill kernel (fp32 loops, and AMX where the CPU has it), the SDPA path's dequantized gather, and the fused rotary
+ cache write. Reads are checked against the oracle on the dequantized cache (stored * scale in fp32, kernels.kv8)
to fp32 rounding; writes byte for byte against torch's cast (kv8.quantize)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import attention, kv8, native
from pagedserve.kernels.attention import cpu as attention_cpu
from pagedserve.kernels.attention import cpu_prefill, reference
from pagedserve.kernels.attention.reference import NO_MODS, ScoreMods
from pagedserve.kernels.rope import cpu as rope_cpu
from pagedserve.kernels.rope.cos_sin import compute_cos_sin_cache
from tests.support.kernel_checks import needs_native
from tests.support.paged_attention import (
    BF16_TOL,
    FP32_TOL,
    MIXED,
    PagedBatch,
    make_batch,
    per_sequence_attention,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
# A bf16 query's output is the fp32 result rounded once to bf16: one bf16 step of slack over fp32's.
BF16_OUT_TOL = {"atol": 2e-3, "rtol": 8e-3}
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_OUT_TOL}
ODD = [(1, 1), (1, 7), (1, 16), (1, 17), (1, 33), (1, 100), (1, 161)]
# Scales that spread randn over the format: some keys saturate at e4m3's 448 * k_scale, some go subnormal.
K_SCALE, V_SCALE = 0.0061, 0.37


def _fp8_batch(lens, num_kv_heads, group, head_dim, block_size, fp8, dtype=torch.float32, seed=0,
               k_scale=K_SCALE, v_scale=V_SCALE) -> tuple[PagedBatch, PagedBatch]:
    """The batch with fp8 caches (query in `dtype`), and its oracle twin: the caches dequantized to fp32 and the
    query in fp32 (exactly the values the kernel reads)."""
    batch = make_batch(lens, num_kv_heads, group, head_dim, block_size, seed=seed)
    batch.key_cache.mul_(3.0)  # past e4m3's range at K_SCALE, into e5m2's subnormals
    for cache in (batch.key_cache, batch.value_cache):  # every magnitude: both formats' subnormals and zeros
        ladder = cache.view(-1)[::29]
        ladder.copy_(torch.logspace(-9, 0, ladder.numel()) * ladder.sign())
    batch.query = batch.query.to(dtype)
    batch.key_cache = kv8.quantize(batch.key_cache, fp8, k_scale)
    batch.value_cache = kv8.quantize(batch.value_cache, fp8, v_scale)
    oracle = PagedBatch(batch.query.float(), kv8.dequantize(batch.key_cache, k_scale),
                        kv8.dequantize(batch.value_cache, v_scale), batch.block_tables, batch.cu_seqlens_q,
                        batch.seq_lens, batch.scale)
    return batch, oracle


def _poison_spare_blocks(batch: PagedBatch) -> None:
    """Table entries past each sequence's blocks name a block of fp8 NaNs: reading past a length shows."""
    block_size = batch.key_cache.shape[1]
    lens = batch.seq_lens.tolist()
    used = {int(b) for s, n in enumerate(lens) for b in batch.block_tables[s, : -(-n // block_size)]}
    spare = max(set(range(batch.key_cache.shape[0])) - used)
    batch.key_cache.view(torch.uint8)[spare] = 0x7F  # NaN in e4m3fn, NaN in e5m2
    batch.value_cache.view(torch.uint8)[spare] = 0x7F
    for s, n in enumerate(lens):
        batch.block_tables[s, -(-n // block_size):] = spare


@pytest.fixture(params=[False, True], ids=["vector", "portable"])
def path(request, monkeypatch):
    monkeypatch.setattr(attention_cpu, "PORTABLE_DECODE", request.param)
    return request.param


def _attention(batch: PagedBatch, window=None, soft_cap=None, k_scale=K_SCALE, v_scale=V_SCALE) -> torch.Tensor:
    return attention_cpu.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap,
                                         k_scale=k_scale, v_scale=v_scale)


def _at_threads(threads: int, fn):
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn()
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"),
                         [(3, 3, 64, 16), (2, 4, 128, 16), (1, 8, 80, 32), (4, 1, 96, 8), (2, 2, 40, 1), (1, 7, 36, 64)])
def test_decode_reads_fp8_as_the_oracle_on_the_dequantized_cache(path, fp8, dtype, num_kv_heads, group, head_dim,
                                                                 block_size):
    batch, oracle = _fp8_batch(ODD, num_kv_heads, group, head_dim, block_size, fp8, dtype, seed=3)
    _poison_spare_blocks(batch)
    out = _attention(batch)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), per_sequence_attention(oracle), **TOL[dtype])


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(("window", "soft_cap"), [(1, None), (15, None), (40, 2.0), (None, 1.5)])
def test_decode_fp8_with_windows_and_soft_caps(path, fp8, window, soft_cap):
    batch, oracle = _fp8_batch(ODD, 2, 3, 64, 16, fp8, seed=4)
    batch.query.mul_(3.0)  # scores of several units, where a cap bends them
    oracle.query.mul_(3.0)
    _poison_spare_blocks(batch)
    out = _attention(batch, window, soft_cap)
    torch.testing.assert_close(out, per_sequence_attention(oracle, window, soft_cap), **FP32_TOL)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[(1, 3000)], [(1, 1200), (1, 9), (1, 2047)]], ids=["one", "three"])
def test_decode_fp8_cut_across_threads_merges_to_the_oracle(path, fp8, dtype, lens):
    # Fewer sequences than twice the threads, over 512 keys a thread: flash-decoding's split, merged by lse.
    batch, oracle = _fp8_batch(lens, 3, 3, 64, 16, fp8, dtype, seed=5)
    _poison_spare_blocks(batch)
    many = _at_threads(3, lambda: _attention(batch))
    torch.testing.assert_close(many.float(), per_sequence_attention(oracle), **TOL[dtype])


@needs_native
def test_decode_scales_are_the_contracts_read_rule():
    # Unit scales read the stored numbers themselves; a scale is the same as dequantizing with it.
    batch, oracle = _fp8_batch(ODD, 2, 2, 64, 16, torch.float8_e4m3fn, seed=8, k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(_attention(batch, k_scale=1.0, v_scale=1.0), per_sequence_attention(oracle),
                               **FP32_TOL)
    oracle.key_cache.mul_(0.5)
    oracle.value_cache.mul_(4.0)
    torch.testing.assert_close(_attention(batch, k_scale=0.5, v_scale=4.0), per_sequence_attention(oracle),
                               **FP32_TOL)


needs_amx = pytest.mark.skipif(not cpu_prefill.amx_available(), reason="no AMX-BF16 on this CPU")
# (q_len, seq_len): a fresh odd prompt, chunks after prefixes ending mid-block and mid-tile, a long chunk,
# two tokens after a prefix.
CHUNKS = [(37, 37), (37, 337), (130, 300), (2, 515)]


def _prefill(batch: PagedBatch, mods: ScoreMods = NO_MODS, use_amx: bool = False) -> torch.Tensor:
    outs = []
    starts = batch.cu_seqlens_q.tolist()
    for s in range(batch.seq_lens.numel()):
        outs.append(cpu_prefill.prefill_attention(
            batch.query[starts[s]: starts[s + 1]], batch.key_cache, batch.value_cache, batch.block_tables[s],
            int(batch.seq_lens[s]), batch.scale, mods, use_amx=use_amx, kv_scales=(K_SCALE, V_SCALE)))
    return torch.cat(outs)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"),
                         [(3, 3, 64, 16), (1, 8, 128, 16), (2, 4, 80, 8)])
def test_prefill_kernel_reads_fp8_as_the_oracle(fp8, dtype, num_kv_heads, group, head_dim, block_size):
    batch, oracle = _fp8_batch(CHUNKS, num_kv_heads, group, head_dim, block_size, fp8, dtype, seed=11)
    _poison_spare_blocks(batch)
    out = _prefill(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), per_sequence_attention(oracle), **TOL[dtype])


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("mods", [ScoreMods(sliding_window=50), ScoreMods(sliding_window=100, soft_cap=2.0)],
                         ids=["window", "window-cap"])
def test_prefill_kernel_fp8_with_windows_and_soft_caps(fp8, mods):
    batch, oracle = _fp8_batch(CHUNKS, 2, 4, 64, 16, fp8, seed=12)
    out = _prefill(batch, mods)
    torch.testing.assert_close(out, per_sequence_attention(oracle, mods.sliding_window, mods.soft_cap), **FP32_TOL)


@needs_native
@needs_amx
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("mods", [NO_MODS, ScoreMods(sliding_window=70), ScoreMods(soft_cap=3.0)],
                         ids=["plain", "window", "cap"])
def test_amx_prefill_widens_fp8_tiles_to_bf16(fp8, mods):
    # AMX multiplies bf16 probabilities: the bf16 cache path's tolerance (fp8 values are exact in bf16).
    batch, oracle = _fp8_batch(CHUNKS, 3, 3, 64, 32, fp8, torch.bfloat16, seed=13)
    _poison_spare_blocks(batch)
    out = _prefill(batch, mods, use_amx=True)
    torch.testing.assert_close(out.float(), per_sequence_attention(oracle, mods.sliding_window, mods.soft_cap),
                               **BF16_TOL)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefill_kernel", ["1", "0"], ids=["kernel-where-preferred", "sdpa"])
def test_engine_cpu_path_on_a_mixed_step(fp8, dtype, prefill_kernel, monkeypatch):
    # Decodes beside chunks: the native decode kernel, and per chunk the prefill kernel where preferred (bf16 on
    # AMX) or SDPA on the gathered context dequantized (fresh prompt, chunk after a prefix, windowed).
    monkeypatch.setenv(cpu_prefill.ENV_SWITCH, prefill_kernel)
    batch, oracle = _fp8_batch(MIXED, 3, 3, 64, 16, fp8, dtype, seed=14)
    tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    torch.testing.assert_close(_attention(batch).float(), per_sequence_attention(oracle), **tol)
    torch.testing.assert_close(_attention(batch, window=20).float(), per_sequence_attention(oracle, 20), **tol)


@needs_native
def test_public_entry_routes_fp8_to_the_cpu_kernels(monkeypatch):
    batch, oracle = _fp8_batch(MIXED, 2, 2, 64, 16, torch.float8_e4m3fn, seed=15)
    monkeypatch.setattr(reference, "paged_attention", None)  # a fall back to the reference would fail
    out = attention.paged_attention(*batch.args(), k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, per_sequence_attention(oracle), **FP32_TOL)


def _fused_write(key: torch.Tensor, value: torch.Tensor, fp8: torch.dtype, k_scale: float, v_scale: float,
                 positions: torch.Tensor | None = None, slots: torch.Tensor | None = None):
    """The fused rotary + cache write of key/value ([T, Hkv, D]) into fresh fp8 caches (block size 4); returns
    (rotated query, key cache, value cache) with the caches flattened to [slots, Hkv, D]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    cos_sin = compute_cos_sin_cache(head_dim, 4096, 10000.0, None, torch.float32)
    positions = torch.zeros(num_tokens, dtype=torch.int64) if positions is None else positions
    slots = torch.arange(num_tokens) if slots is None else slots
    shape = (-(-num_tokens // 4) + 1, 4, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=fp8), torch.zeros(shape, dtype=fp8)
    query = torch.randn(num_tokens, 2, head_dim, generator=torch.Generator().manual_seed(0)).to(key.dtype)
    q_out = rope_cpu.rotary_embedding_and_cache(positions, query, key, value, cos_sin, key_cache, value_cache, slots,
                                                k_scale=k_scale, v_scale=v_scale)
    assert q_out is not None  # served natively
    return q_out, key_cache.flatten(0, 1), value_cache.flatten(0, 1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("v_scale", [1.0, 0.37, 1e-3])
def test_write_quantizes_every_bf16_value_as_torch_does(fp8, v_scale):
    # All 2^16 bf16 bit patterns (NaNs, infinities, subnormals, everything past the format's range) as values.
    value = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    value = value.reshape(-1, 2, 32)
    key = torch.zeros_like(value)
    _, _, value_cache = _fused_write(key, value, fp8, 1.0, v_scale)
    expected = kv8.quantize(value, fp8, v_scale)
    assert torch.equal(_bytes(value_cache[: value.shape[0]]), _bytes(expected))


def _fp32_cases(fp8: torch.dtype) -> torch.Tensor:
    """fp32 values at and beside every fp8 number and every midpoint between neighbours (round-to-even ties),
    subnormals of both, fp32 subnormals, the saturation edge and beyond, and plain random ones."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    points = torch.cat([finite, mids, torch.tensor([1e-45, 3e-39, 1e-30, 5e4, 6e4, 1e6, float("inf")])])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(float("inf"))),
                      torch.nextafter(points, torch.tensor(-float("inf")))])
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(20000, generator=gen) * torch.logspace(-12, 6, 20000)
    values = torch.cat([near, -near, random])
    return values[: values.numel() // 64 * 64].reshape(-1, 2, 32)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("v_scale", [1.0, 0.37])
def test_write_quantizes_fp32_ties_subnormals_and_out_of_range_as_torch_does(fp8, v_scale):
    value = _fp32_cases(fp8)
    _, _, value_cache = _fused_write(torch.zeros_like(value), value, fp8, 1.0, v_scale)
    assert torch.equal(_bytes(value_cache[: value.shape[0]]), _bytes(kv8.quantize(value, fp8, v_scale)))


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rotary_write_stores_the_rotated_key_quantized(fp8, dtype):
    # The key is rotated as the native rotary rounds it (in the activations' dtype), then cast as torch casts:
    # identical bytes to rotary_embedding followed by the reference write. Slot -1 writes nothing.
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(40, 3, 64, generator=gen) * 3).to(dtype)
    value = torch.randn(40, 3, 64, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (40,), generator=gen)
    slots = torch.randperm(44, generator=gen)[:40]
    slots[5] = -1
    q_out, key_cache, value_cache = _fused_write(key, value, fp8, 0.05, 0.2, positions, slots)
    query = torch.randn(40, 2, 64, generator=torch.Generator().manual_seed(0)).to(dtype)  # _fused_write's query
    cos_sin = compute_cos_sin_cache(64, 4096, 10000.0, None, torch.float32)
    q_rot, k_rot = rope_cpu.rotary_embedding(positions, query, key, cos_sin)
    keep = slots >= 0
    assert torch.equal(q_out, q_rot)
    assert torch.equal(_bytes(key_cache[slots[keep]]), _bytes(kv8.quantize(k_rot[keep], fp8, 0.05)))
    assert torch.equal(_bytes(value_cache[slots[keep]]), _bytes(kv8.quantize(value[keep], fp8, 0.2)))
    untouched = torch.ones(key_cache.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not _bytes(key_cache[untouched]).any() and not _bytes(value_cache[untouched]).any()


@pytest.fixture(scope="module", params=["x86-64-v3", "x86-64"], ids=["avx2", "sse2"])
def other_build(request, tmp_path_factory):
    """The decode kernel and the fused write built for AVX2 + F16C (x86-64-v3: the vector fp8 reads AVX2 CPUs run)
    or plain x86-64 (the scalar fp8 reads), instead of this CPU's AVX-512."""
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    kernels = Path(native.__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("kv8") / f"kv8_{request.param}.so"
    flags = [f for f in native.FLAGS if f != "-march=native"] + [f"-march={request.param}"]
    sources = [kernels / "attention" / "paged_attention.cpp", kernels / "rope" / "rotary.cpp"]
    result = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(out)], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        pytest.skip(f"no {request.param} build: {result.stderr[-300:]}")
    return ctypes.CDLL(str(out))


def _entry(library: ctypes.CDLL, function: native.Function):
    """A native.Function's entry point taken from another build of the library."""
    entry = getattr(library, function.name)
    entry.restype, entry.argtypes = ctypes.c_int, function._argtypes

    def call(*args):
        assert entry(*args) == 0

    return call


@needs_native
@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")),
                    reason="an x86-64 CPU with AVX2 runs the AVX2 build")
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_builds_without_avx512_read_and_write_fp8_alike(other_build, fp8, monkeypatch):
    monkeypatch.setattr(attention_cpu, "_decode_kernel", _entry(other_build, attention_cpu._decode_kernel))
    monkeypatch.setattr(rope_cpu, "_rotary_and_cache_kernel", _entry(other_build, rope_cpu._rotary_and_cache_kernel))
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.float32, 36)):
        batch, oracle = _fp8_batch(ODD, 2, 3, head_dim, 16, fp8, dtype, seed=21)
        _poison_spare_blocks(batch)
        torch.testing.assert_close(_attention(batch, window=40, soft_cap=2.0).float(),
                                   per_sequence_attention(oracle, 40, 2.0), **TOL[dtype])
    value = _fp32_cases(fp8)
    _, _, value_cache = _fused_write(torch.zeros_like(value), value, fp8, 1.0, 0.37)
    assert torch.equal(_bytes(value_cache[: value.shape[0]]), _bytes(kv8.quantize(value, fp8, 0.37)))
