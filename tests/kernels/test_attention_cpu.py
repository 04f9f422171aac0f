"""The engine's CPU attention (native in-place decode kernel + unpadded prefill) against a per-sequence one."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from pagedserve.kernels import native
from pagedserve.kernels.attention import cpu as attention_cpu
from tests.support.kernel_checks import needs_native
from tests.support.paged_attention import (
    BF16_TOL,
    DECODES,
    FP32_TOL,
    MIXED,
    make_batch,
    per_sequence_attention,
)


@needs_native
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"),
                         [(2, 1, 64, 16), (2, 4, 80, 32), (1, 8, 64, 16), (3, 3, 16, 16)])
def test_cpu_attention_equals_per_sequence_attention_in_fp32(lens, num_kv_heads, group, head_dim, block_size):
    batch = make_batch(lens, num_kv_heads, group, head_dim, block_size)
    out = attention_cpu.paged_attention(*batch.args())
    torch.testing.assert_close(out, per_sequence_attention(batch), **FP32_TOL)


@needs_native
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_cpu_attention_in_bf16_stays_within_bf16_rounding_of_fp32(lens):
    batch = make_batch(lens, 2, 4, 64, 16, dtype=torch.bfloat16)
    out = attention_cpu.paged_attention(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), per_sequence_attention(batch), **BF16_TOL)


@needs_native
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)], ids=["fp32", "bf16"])
def test_chunks_after_a_long_cached_prefix_merge_two_flash_passes_exactly(dtype, tol, monkeypatch):
    # Chunks of several lengths after prefixes that end mid-block, beside a fresh prompt and a decode.
    lens = [(37, 337), (64, 1000), (1, 90), (23, 23), (2, 515)]
    batch = make_batch(lens, 3, 3, 64, 16, dtype=dtype)
    monkeypatch.setenv("PAGEDSERVE_PREFILL_KERNEL", "0")  # the SDPA path (bf16 on AMX takes the native kernel)
    calls = []
    merge = attention_cpu._chunk_after_prefix
    monkeypatch.setattr(attention_cpu, "_chunk_after_prefix", lambda *a: calls.append(a[0].shape[0]) or merge(*a))
    out = attention_cpu.paged_attention(*batch.args())
    assert calls == [37, 64, 2]
    torch.testing.assert_close(out.float(), per_sequence_attention(batch), **tol)


@needs_native
def test_native_decode_splits_sequences_across_threads_with_the_same_result():
    lens = [(1, n) for n in range(1, 97)]
    batch = make_batch(lens, 2, 4, 64, 16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention_cpu.paged_attention(*batch.args())
        torch.set_num_threads(4)
        four = attention_cpu.paged_attention(*batch.args())
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, four)
    torch.testing.assert_close(one, per_sequence_attention(batch), **FP32_TOL)


@needs_native
def test_native_decode_writes_into_a_given_out_tensor():
    batch = make_batch(DECODES, 2, 2, 64, 16)
    out = torch.full_like(batch.query, float("nan"))
    result = attention_cpu.paged_attention(*batch.args(), out)
    assert result is out
    torch.testing.assert_close(out, per_sequence_attention(batch), **FP32_TOL)


def test_without_a_compiler_the_cpu_attention_falls_back_to_the_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_load_failed", False)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    batch = make_batch(MIXED, 2, 2, 64, 16)
    assert native.load() is None
    torch.testing.assert_close(attention_cpu.paged_attention(*batch.args()), per_sequence_attention(batch),
                               **FP32_TOL)


def test_native_build_is_cached_by_source_and_cpu(monkeypatch, tmp_path):
    # Two one-line sources stand in for the kernels: the cache logic is the same, the build takes a second.
    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    for index, source in enumerate(sources):
        source.write_text(f'extern "C" int pagedserve_probe_{index}(void) {{ return {index}; }}\n')
    monkeypatch.setattr(native, "SOURCES", tuple(sources))
    monkeypatch.setattr(native, "HEADERS", ())
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_load_failed", False)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    if native.load() is None:
        pytest.skip("no C++ compiler for the native kernel")
    assert native.load().pagedserve_probe_1() == 1  # every source compiled and linked into the one library
    built = list((tmp_path / "kernels").glob("pagedserve_cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_library", None)
    assert native.load() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    sources[1].write_text('extern "C" int pagedserve_probe_1(void) { return 7; }\n')
    monkeypatch.setattr(native, "_library", None)
    assert native.load().pagedserve_probe_1() == 7  # another source, another library
    assert len(list((tmp_path / "kernels").glob("pagedserve_cpu-*.so"))) == 2


def test_two_builders_of_one_library_compile_it_once(monkeypatch, tmp_path):
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler for the native kernel")
    source = tmp_path / "a.cpp"
    source.write_text('extern "C" int pagedserve_probe(void) { return 3; }\n')
    monkeypatch.setattr(native, "SOURCES", (source,))
    commands = []
    run = native._run_compiler
    monkeypatch.setattr(native, "_run_compiler", lambda command: (commands.append(command), run(command)))
    target = tmp_path / "kernels" / "pagedserve_cpu-test.so"
    # Separate threads open the lock file separately: flock excludes them as it does two worker processes.
    builders = [threading.Thread(target=native._build, args=(compiler, target)) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert len(commands) == 2  # one compile, one link: the second builder found the library made
    assert ctypes.CDLL(str(target)).pagedserve_probe() == 3
