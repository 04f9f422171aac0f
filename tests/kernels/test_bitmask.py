"""The grammar bitmask op: the torch reference against xgrammar's own kernel (the packing oracle), Triton
against the reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.bitmask import reference
from pagedserve.kernels.bitmask import triton as bitmask_triton

DTYPES = [torch.float32, torch.bfloat16]


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # a row allowing everything
    if rows > 1:
        bitmask[1] = 0  # and one allowing nothing
    return logits, bitmask


@pytest.mark.parametrize("vocab", [32, 100, 5000])
def test_reference_equals_xgrammar_on_every_row(vocab):
    xgrammar = pytest.importorskip("xgrammar")
    logits, bitmask = _case(4, vocab, torch.float32)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    reference.apply_token_bitmask(logits, bitmask, torch.arange(4))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_reference_masks_only_the_given_rows():
    logits, bitmask = _case(3, 70, torch.float32, seed=1)
    before = logits.clone()
    reference.apply_token_bitmask(logits, bitmask[:2], torch.tensor([2, 0]))
    torch.testing.assert_close(logits[1], before[1], rtol=0, atol=0)
    bit = lambda row, t: (int(bitmask[row, t // 32]) >> (t % 32)) & 1  # noqa: E731
    for t in range(70):
        assert (logits[2, t] == -float("inf")) == (not bit(0, t))
        assert (logits[0, t] == -float("inf")) == (not bit(1, t))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [37, 4096, 5000])  # a partial word; exactly one tile; two tiles
def test_triton_equals_reference(dtype, vocab):
    logits, bitmask = _case(5, vocab, dtype, seed=vocab)
    rows = torch.tensor([4, 1, 2])
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask[:3], rows)
    bitmask_triton.apply_token_bitmask(logits, bitmask[:3].contiguous(), rows)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)  # bf16 takes the reference inside the CPU module
@pytest.mark.parametrize("vocab", [37, 5000])
def test_cpu_equals_reference_on_a_subset_of_rows(dtype, vocab):
    from pagedserve.kernels.bitmask import cpu

    logits, bitmask = _case(6, vocab, dtype, seed=vocab + 1)
    rows = torch.tensor([5, 0, 3])
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask[:3], rows)
    cpu.apply_token_bitmask(logits, bitmask[:3].contiguous(), rows)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
