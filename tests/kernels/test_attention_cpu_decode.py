"""The native CPU decode kernel's paths against the per-sequence oracle: the AVX-512 tiles (vdpbf16ps on a bf16
cache where the CPU has it) and the portable loops AVX2 CPUs take, GQA groups, head sizes off the compiled ones,
odd lengths, small blocks, tables with spare columns, windows and soft caps, and the split of the keys among
threads (whole sequences, or one long context cut into parts merged by log-sum-exp)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention import cpu as attention_cpu
from tests.support.kernel_checks import needs_native
from tests.support.paged_attention import BF16_TOL, FP32_TOL, make_batch, per_sequence_attention

# Odd lengths: one key, a partial tile, exactly a tile, across block and tile edges, several tiles.
ODD = [(1, 1), (1, 7), (1, 16), (1, 17), (1, 33), (1, 100), (1, 161)]
TOL = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}


@pytest.fixture(params=[False, True], ids=["vector", "portable"])
def path(request, monkeypatch):
    monkeypatch.setattr(attention_cpu, "PORTABLE_DECODE", request.param)
    return request.param


def _poison_spare_columns(batch) -> None:
    """Table entries past each sequence's blocks name a block of NaNs: reading past a length shows."""
    block_size = batch.key_cache.shape[1]
    used = {int(b) for s, n in enumerate(batch.seq_lens.tolist()) for b in batch.block_tables[s, : -(-n // block_size)]}
    spare = max(set(range(batch.key_cache.shape[0])) - used)  # make_batch leaves 7 blocks unused
    batch.key_cache[spare] = float("nan")
    batch.value_cache[spare] = float("nan")
    for s, n in enumerate(batch.seq_lens.tolist()):
        batch.block_tables[s, -(-n // block_size) :] = spare


def _decode(batch, window=None, soft_cap=None) -> torch.Tensor:
    return attention_cpu.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"),
                         [(3, 3, 64, 16), (2, 4, 128, 16), (1, 8, 80, 32), (4, 1, 96, 8), (2, 2, 40, 1), (1, 7, 32, 64)])
def test_decode_paths_equal_the_oracle_for_gqa_groups_and_odd_lengths(path, dtype, num_kv_heads, group, head_dim,
                                                                       block_size):
    batch = make_batch(ODD, num_kv_heads, group, head_dim, block_size, dtype=dtype, seed=3)
    _poison_spare_columns(batch)
    out = _decode(batch)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), per_sequence_attention(batch), **TOL[dtype])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "soft_cap"), [(1, None), (15, None), (16, None), (40, 2.0), (None, 1.5)])
def test_decode_paths_with_windows_and_soft_caps_equal_the_oracle(path, dtype, window, soft_cap):
    batch = make_batch(ODD, 2, 3, 64, 16, dtype=dtype, seed=4)
    batch.query.mul_(3.0)  # scores of several units, where a cap bends them
    _poison_spare_columns(batch)
    out = _decode(batch, window, soft_cap)
    torch.testing.assert_close(out.float(), per_sequence_attention(batch, window, soft_cap), **TOL[dtype])


def _at_threads(threads: int, fn):
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return fn()
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[(1, 3000)], [(1, 2100), (1, 1500)], [(1, 1200), (1, 9), (1, 2047)]],
                         ids=["one", "two", "three"])
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_long_contexts_cut_across_threads_merge_to_the_oracle(path, dtype, lens, threads):
    # Fewer sequences than twice the threads, over 512 keys a thread: the kernel cuts the contexts into parts.
    batch = make_batch(lens, 3, 3, 64, 16, dtype=dtype, seed=5)
    _poison_spare_columns(batch)
    one = _at_threads(1, lambda: _decode(batch))
    many = _at_threads(threads, lambda: _decode(batch))
    expected = per_sequence_attention(batch)
    torch.testing.assert_close(many.float(), expected, **TOL[dtype])
    torch.testing.assert_close(one.float(), expected, **TOL[dtype])
    # Merging pieces only reorders fp32 sums: far closer to the single pass than the dtype's tolerance.
    torch.testing.assert_close(many.float(), one.float(), atol=1e-5 if dtype == torch.float32 else 8e-3, rtol=1e-5)


@needs_native
@pytest.mark.parametrize(("window", "soft_cap"), [(1500, None), (1100, 2.0)])
def test_cut_contexts_keep_windows_and_soft_caps(window, soft_cap):
    batch = make_batch([(1, 2600), (1, 700)], 2, 4, 64, 16, seed=6)
    batch.query.mul_(3.0)
    out = _at_threads(3, lambda: _decode(batch, window, soft_cap))
    torch.testing.assert_close(out, per_sequence_attention(batch, window, soft_cap), **FP32_TOL)


@needs_native
def test_many_sequences_are_shared_whole_so_threads_do_not_change_a_bit():
    lens = [(1, 300 + 37 * i) for i in range(12)]
    batch = make_batch(lens, 2, 4, 64, 16, dtype=torch.bfloat16, seed=7)
    one = _at_threads(1, lambda: _decode(batch))
    for threads in (2, 3):
        assert torch.equal(_at_threads(threads, lambda: _decode(batch)), one)
