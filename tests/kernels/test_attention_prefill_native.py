"""The native prefill attention kernel (flash-style over the block table) against the per-sequence oracle."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention import cpu as attention_cpu
from pagedserve.kernels.attention import cpu_prefill
from pagedserve.kernels.attention.reference import NO_MODS, ScoreMods
from tests.support.kernel_checks import needs_native
from tests.support.paged_attention import BF16_TOL, FP32_TOL, make_batch, per_sequence_attention

needs_amx = pytest.mark.skipif(not cpu_prefill.amx_available(), reason="no AMX-BF16 on this CPU")
# (q_len, seq_len): a fresh odd-length prompt, chunks after prefixes ending mid-block and mid-tile, a chunk
# longer than one query block, a two-token chunk, one token after a prefix.
CHUNKS = [(37, 37), (37, 337), (130, 300), (2, 515), (1, 90), (200, 200)]


def _run(batch, mods: ScoreMods = NO_MODS, use_amx: bool = False) -> torch.Tensor:
    outs = []
    starts = batch.cu_seqlens_q.tolist()
    for s in range(batch.seq_lens.numel()):
        query = batch.query[starts[s] : starts[s + 1]]
        outs.append(cpu_prefill.prefill_attention(query, batch.key_cache, batch.value_cache, batch.block_tables[s],
                                                  int(batch.seq_lens[s]), batch.scale, mods, use_amx=use_amx))
    return torch.cat(outs)


def _oracle(batch, mods: ScoreMods = NO_MODS) -> torch.Tensor:
    return per_sequence_attention(batch, window=mods.sliding_window, soft_cap=mods.soft_cap)


@needs_native
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"),
                         [(3, 3, 64, 16), (2, 1, 64, 32), (1, 8, 128, 16), (2, 4, 80, 8)])
def test_portable_kernel_equals_the_oracle_in_fp32(num_kv_heads, group, head_dim, block_size):
    batch = make_batch(CHUNKS, num_kv_heads, group, head_dim, block_size)
    torch.testing.assert_close(_run(batch), _oracle(batch), **FP32_TOL)


@needs_native
@pytest.mark.parametrize("mods", [ScoreMods(sliding_window=50), ScoreMods(soft_cap=5.0),
                                  ScoreMods(sliding_window=100, soft_cap=2.0), ScoreMods(sliding_window=1)],
                         ids=["window", "soft-cap", "both", "window-1"])
def test_portable_kernel_applies_window_and_soft_cap(mods):
    batch = make_batch(CHUNKS, 2, 4, 64, 16, seed=1)
    torch.testing.assert_close(_run(batch, mods), _oracle(batch, mods), **FP32_TOL)


@needs_native
@pytest.mark.parametrize("use_amx", [False, pytest.param(True, marks=needs_amx)], ids=["portable", "amx"])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (1, 8, 128), (2, 1, 64), (1, 2, 256)])
def test_bf16_kernels_stay_within_bf16_rounding(use_amx, num_kv_heads, group, head_dim):
    batch = make_batch(CHUNKS, num_kv_heads, group, head_dim, 16, dtype=torch.bfloat16, seed=2)
    out = _run(batch, use_amx=use_amx)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _oracle(batch), **BF16_TOL)


@needs_native
@needs_amx
@pytest.mark.parametrize("block_size", [1, 8, 32, 48])
def test_amx_kernel_reads_rows_of_any_block_size(block_size):
    # Blocks holding whole groups of 16 keys take one table read per group, smaller ones one per key.
    batch = make_batch(CHUNKS, 3, 3, 64, block_size, dtype=torch.bfloat16, seed=4)
    torch.testing.assert_close(_run(batch, use_amx=True).float(), _oracle(batch), **BF16_TOL)


@needs_native
@needs_amx
@pytest.mark.parametrize("mods", [ScoreMods(sliding_window=70), ScoreMods(soft_cap=3.0)], ids=["window", "cap"])
def test_amx_kernel_applies_window_and_soft_cap(mods):
    batch = make_batch(CHUNKS, 3, 3, 64, 32, dtype=torch.bfloat16, seed=3)
    torch.testing.assert_close(_run(batch, mods, use_amx=True).float(), _oracle(batch, mods), **BF16_TOL)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_outside_the_context_or_window_are_never_read(dtype):
    # Poison every block the chunk must not read: the table's spare entries, and the blocks a window has left.
    batch = make_batch([(40, 300)], 2, 2, 64, 16, dtype=dtype, seed=4)
    mods = ScoreMods(sliding_window=64)
    expected = _oracle(batch, mods)
    table = batch.block_tables[0]
    for index in [*range(0, (300 - 40 - 63) // 16), *range(-(-300 // 16), table.numel())]:
        batch.key_cache[table[index]] = float("nan")
        batch.value_cache[table[index]] = float("nan")
    for use_amx in [False, *([True] if dtype == torch.bfloat16 and cpu_prefill.amx_available() else [])]:
        out = _run(batch, mods, use_amx=use_amx).float()
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


@needs_native
def test_work_split_across_threads_gives_the_same_result():
    batch = make_batch([(300, 700)], 4, 2, 64, 16, dtype=torch.bfloat16, seed=5)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(batch)
        torch.set_num_threads(3)
        three = _run(batch)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, three)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_cpu_path_uses_the_kernel_where_preferred(dtype, monkeypatch):
    batch = make_batch([(37, 337), (1, 90), (23, 23)], 3, 3, 64, 16, dtype=dtype, seed=6)
    calls = []
    kernel = cpu_prefill.prefill_attention
    monkeypatch.setattr(cpu_prefill, "prefill_attention", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    out = attention_cpu.paged_attention(*batch.args())
    preferred = cpu_prefill.preferred(batch.query, batch.key_cache)
    assert calls == ([37, 23] if preferred else [])
    torch.testing.assert_close(out.float(), per_sequence_attention(batch), **(FP32_TOL if dtype == torch.float32
                                                                             else BF16_TOL))
    monkeypatch.setenv(cpu_prefill.ENV_SWITCH, "0")
    assert not cpu_prefill.preferred(batch.query, batch.key_cache)


def test_a_chunk_past_its_block_table_is_refused():
    batch = make_batch([(4, 20)], 1, 1, 64, 16)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_prefill.prefill_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables[0][:1],
                                      20, batch.scale)
