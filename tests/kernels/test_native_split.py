"""RangeSplitter: the native kernels' one way to split rows over threads (attention decode, quantized GEMM)."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedserve.kernels.native.split import RangeSplitter, openmp_available


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
    calls = _record(RangeSplitter("test-split", min_per_thread=8, use_openmp=False), 100)
    assert [(b, e) for b, e, _ in calls] == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert all(name.startswith("test-split") for _, _, name in calls)


def test_too_few_rows_for_two_threads_run_once_on_the_callers_thread(four_threads):
    calls = _record(RangeSplitter("test-split", min_per_thread=8), 15)
    assert calls == [(0, 15, threading.current_thread().name)]


def test_the_pool_follows_a_changed_thread_count(four_threads):
    split = RangeSplitter("test-split", min_per_thread=1, use_openmp=False)
    assert len(_record(split, 12)) == 4
    torch.set_num_threads(3)
    assert [(b, e) for b, e, _ in _record(split, 12)] == [(0, 4), (4, 8), (8, 12)]


@pytest.mark.skipif(not openmp_available(), reason="the native library was built without OpenMP")
def test_on_the_openmp_team_each_range_runs_once_on_its_own_thread(four_threads):
    calls, lock = [], threading.Lock()

    def run(begin: int, end: int) -> None:
        with lock:
            calls.append((begin, end, threading.get_ident()))

    RangeSplitter("test-split", min_per_thread=8, use_openmp=True)(run, 100)
    assert sorted((b, e) for b, e, _ in calls) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert len({ident for _, _, ident in calls}) == 4
    assert threading.get_ident() in {ident for _, _, ident in calls}  # the caller runs a range itself


@pytest.mark.skipif(not openmp_available(), reason="the native library was built without OpenMP")
def test_an_error_in_a_range_on_the_openmp_team_is_raised_to_the_caller(four_threads):
    def run(begin: int, end: int) -> None:
        if begin == 50:
            raise ValueError(f"range {begin}:{end} failed")

    with pytest.raises(ValueError, match="range 50:75 failed"):
        RangeSplitter("test-split", min_per_thread=8, use_openmp=True)(run, 100)


def test_the_default_takes_the_openmp_team_where_the_library_has_it(four_threads):
    calls = _record(RangeSplitter("test-split", min_per_thread=8), 100)
    on_pool = all(name.startswith("test-split") for _, _, name in calls)
    assert on_pool != openmp_available()
