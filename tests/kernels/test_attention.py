"""Paged attention: the batched torch reference and the Triton kernels against a slow per-sequence one."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention import reference
from pagedserve.kernels.attention import triton as attention_triton
from tests.support.paged_attention import (
    BF16_TOL,
    DECODES,
    FP32_TOL,
    MIXED,
    PagedBatch,
    make_batch,
    per_sequence_attention,
)

SHAPES = [
    pytest.param(kv, g, d, bs, id=f"gqa{g}-d{d}-bs{bs}")
    for kv, g in ((2, 1), (2, 4), (1, 8))
    for d in (64, 80)
    for bs in (16, 32)
]
# Every pair of (GQA ratio, head size, block size) values appears once: the interpreter is slow.
PAIRWISE_SHAPES = [
    pytest.param(kv, g, d, bs, id=f"gqa{g}-d{d}-bs{bs}")
    for kv, g, d, bs in ((2, 1, 64, 16), (2, 1, 80, 32), (2, 4, 64, 32), (2, 4, 80, 16), (1, 8, 64, 16),
                         (1, 8, 80, 32))
]


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"), SHAPES)
def test_torch_reference_equals_per_sequence_attention(num_kv_heads, group, head_dim, block_size):
    batch = make_batch(MIXED, num_kv_heads, group, head_dim, block_size)
    torch.testing.assert_close(reference.paged_attention(*batch.args()), per_sequence_attention(batch),
                               **FP32_TOL)


@pytest.mark.parametrize("lens", [DECODES, [(5, 20), (16, 16), (2, 40)], [(37, 37)]],
                         ids=["decode-only", "prefill-only", "one-fresh-prompt"])
def test_torch_reference_single_phase_batches_equal_per_sequence_attention(lens):
    batch = make_batch(lens, 2, 4, 64, 16)
    torch.testing.assert_close(reference.paged_attention(*batch.args()), per_sequence_attention(batch),
                               **FP32_TOL)


def test_torch_reference_results_do_not_depend_on_earlier_calls():
    # The reference reuses one gather workspace across calls; a smaller step in between must not leak.
    big, small = make_batch(MIXED, 2, 4, 64, 16, seed=8), make_batch(DECODES[:2], 2, 4, 64, 16, seed=9)
    first = reference.paged_attention(*big.args())
    reference.paged_attention(*small.args())
    assert torch.equal(reference.paged_attention(*big.args()), first)


def test_torch_reference_in_bf16_stays_close_to_fp32_attention():
    batch = make_batch(MIXED, 2, 4, 64, 16, dtype=torch.bfloat16)
    out = reference.paged_attention(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), per_sequence_attention(batch), **BF16_TOL)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"), PAIRWISE_SHAPES)
def test_triton_mixed_prefill_and_decode_batch_equals_reference(num_kv_heads, group, head_dim, block_size):
    batch = make_batch(MIXED, num_kv_heads, group, head_dim, block_size, seed=1)
    torch.testing.assert_close(attention_triton.paged_attention(*batch.args()),
                               per_sequence_attention(batch), **FP32_TOL)


@pytest.mark.parametrize("group", [1, 8])
def test_triton_long_prefill_chunk_uses_large_tiles_and_equals_reference(group):
    # A chunk of >= 256 queries takes the 128-row tiles; a decode rides along in the same launch.
    batch = make_batch([(260, 300), (1, 70)], 1, group, 64, 16, seed=7)
    torch.testing.assert_close(attention_triton.paged_attention(*batch.args()),
                               per_sequence_attention(batch), **FP32_TOL)


@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_triton_pads_larger_head_sizes(head_dim):
    batch = make_batch([(5, 70), (1, 17)], 1, 2, head_dim, 16, seed=2)
    torch.testing.assert_close(attention_triton.paged_attention(*batch.args()),
                               per_sequence_attention(batch), **FP32_TOL)


@pytest.mark.parametrize(("num_splits", "group"), [(1, 4), (2, 1), (4, 4), (8, 8)])
def test_triton_split_k_decode_equals_reference(num_splits, group):
    # The shorter sequences leave whole splits empty; those must weigh nothing in the reduction.
    batch = make_batch(DECODES, 8 // group, group, 80, 16, seed=3)
    out = attention_triton.paged_attention(*batch.args(), num_splits=num_splits)
    torch.testing.assert_close(out, per_sequence_attention(batch), **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_bf16_equals_fp32_attention_within_bf16_rounding(num_splits):
    lens = DECODES if num_splits > 1 else MIXED
    batch = make_batch(lens, 2, 4, 64, 16, dtype=torch.bfloat16, seed=4)
    out = attention_triton.paged_attention(*batch.args(), num_splits=num_splits)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), per_sequence_attention(batch), **BF16_TOL)


def test_triton_writes_into_given_out_tensor():
    batch = make_batch(MIXED, 2, 4, 64, 16, seed=5)
    out = torch.full_like(batch.query, float("nan"))
    result = attention_triton.paged_attention(*batch.args(), out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, per_sequence_attention(batch), **FP32_TOL)


def test_triton_reads_blocks_past_int32_element_offsets():
    # Block ids whose element offset (id * block_size * heads * head_size) exceeds 2**31: int32 address
    # math would wrap to a negative offset. The fp16 pool is only reserved virtual memory (torch.empty does
    # not touch its pages); just the blocks used are written.
    block_size, head_dim = 16, 16
    per_block = block_size * head_dim
    first_far = 2**31 // per_block + 1
    num_blocks = first_far + 64
    key_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16)
    value_cache = torch.empty_like(key_cache)
    gen = torch.Generator().manual_seed(6)
    table = torch.tensor([[num_blocks - 1, 3, first_far + 9, first_far], [first_far + 20, 5, 0, 0]],
                         dtype=torch.int32)
    used = torch.unique(table).long()
    key_cache[used] = torch.randn(used.numel(), block_size, 1, head_dim, generator=gen).half()
    value_cache[used] = torch.randn(used.numel(), block_size, 1, head_dim, generator=gen).half()
    assert int(table.max()) * per_block > 2**31

    decode = PagedBatch(torch.randn(2, 4, head_dim, generator=gen).half(), key_cache, value_cache, table,
                        torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([60, 20], dtype=torch.int32),
                        0.25)
    expected = per_sequence_attention(decode)
    for num_splits in (1, 2):
        out = attention_triton.paged_attention(*decode.args(), num_splits=num_splits)
        torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)

    prefill = PagedBatch(torch.randn(7, 4, head_dim, generator=gen).half(), key_cache, value_cache, table,
                         torch.tensor([0, 4, 7], dtype=torch.int32), torch.tensor([60, 20], dtype=torch.int32),
                         0.25)
    out = attention_triton.paged_attention(*prefill.args())
    torch.testing.assert_close(out.float(), per_sequence_attention(prefill), atol=2e-3, rtol=2e-3)
