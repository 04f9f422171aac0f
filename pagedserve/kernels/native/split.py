"""Running a native kernel over ranges of its rows on several threads: ctypes drops the GIL during the call, so
threads split the work for real, as many as torch's intra-op thread count allows.

Where the native library has OpenMP, the ranges run on torch's own OpenMP team (`split.cpp`): the threads that
run torch's GEMMs, so no second pool competes with them for the cores (OpenMP workers spin a while after each
region, and a pool thread beside them gets half a core). Elsewhere, a Python thread pool runs them.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pagedserve.kernels import native

_RANGE_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64)
_parallel_ranges = native.Function("pagedserve_parallel_ranges", [_RANGE_FN, ctypes.c_int64, ctypes.c_int64])


def openmp_available() -> bool:
    """True when the native library was built with OpenMP (it then shares torch's team of threads)."""
    library = native.load()
    return library is not None and bool(library.pagedserve_openmp())


class RangeSplitter:
    """Runs run(begin, end) over [0, count) in contiguous ranges, one per thread, at least `min_per_thread` items
    each; one call on the caller's thread when there are too few. Ranges run on torch's OpenMP team where the
    native library has OpenMP (`use_openmp`, None: where available), else on a pool that follows the thread
    count."""

    def __init__(self, name: str, min_per_thread: int, use_openmp: bool | None = None) -> None:
        self.name, self.min_per_thread = name, min_per_thread
        self._use_openmp = use_openmp
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def _executor(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._workers != workers:  # resized when torch's thread count changes
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.name)
                self._workers = workers
            return self._pool

    def __call__(self, run: Callable[[int, int], None], count: int) -> None:
        """run(begin, end) over [0, count), split across threads where there are enough items."""
        workers = min(torch.get_num_threads(), count // self.min_per_thread)
        if workers <= 1:
            run(0, count)
            return
        if self._use_openmp is None:
            self._use_openmp = openmp_available()
        if self._use_openmp:
            _on_openmp_team(run, count, workers)
            return
        bounds = [count * i // workers for i in range(workers + 1)]
        futures = [self._executor(workers).submit(run, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        for future in futures:
            future.result()


def _on_openmp_team(run: Callable[[int, int], None], count: int, workers: int) -> None:
    """run over `workers` ranges on torch's OpenMP threads; the first error any range raised is raised here."""
    errors: list[BaseException] = []

    def guarded(begin: int, end: int) -> None:
        try:
            run(begin, end)
        except BaseException as error:  # noqa: BLE001 - a callback cannot raise through C; re-raised below
            errors.append(error)

    callback = _RANGE_FN(guarded)  # held until the call returns: C keeps no reference to it
    _parallel_ranges(callback, count, workers)
    if errors:
        raise errors[0]
