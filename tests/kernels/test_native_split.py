"""RangeSplitter: the native kernels' one way to split rows over threads (attention decode, quantized GEMM)."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedserve.kernels.native.split import RangeSplitter


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def _record(split: RangeSplitter, count: int) -> list[tuple[int, int, str]]:
    calls, lock = [], threading.Lock()

    def run(begin: int, end: int) -> None:
        with lock:
            calls.append((begin, end, threading.current_thread().name))

    split(run, count)
    return sorted(calls)


def test_enough_rows_split_into_contiguous_ranges_one_per_pool_thread(four_threads):
    calls = _record(RangeSplitter("test-split", min_per_thread=8), 100)
    assert [(b, e) for b, e, _ in calls] == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert all(name.startswith("test-split") for _, _, name in calls)


def test_too_few_rows_for_two_threads_run_once_on_the_callers_thread(four_threads):
    calls = _record(RangeSplitter("test-split", min_per_thread=8), 15)
    assert calls == [(0, 15, threading.current_thread().name)]


def test_the_pool_follows_a_changed_thread_count(four_threads):
    split = RangeSplitter("test-split", min_per_thread=1)
    assert len(_record(split, 12)) == 4
    torch.set_num_threads(3)
    assert [(b, e) for b, e, _ in _record(split, 12)] == [(0, 4), (4, 8), (8, 12)]
