"""Running a native kernel over ranges of its rows on several threads: ctypes drops the GIL during the call, so
threads split the work for real, as many as torch's intra-op thread count allows."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


class RangeSplitter:
    """Runs run(begin, end) over [0, count) in contiguous ranges, one per thread, at least `min_per_thread` items
    each; one call on the caller's thread when there are too few. Its pool follows the thread count."""

    def __init__(self, name: str, min_per_thread: int) -> None:
        self.name, self.min_per_thread = name, min_per_thread
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
        bounds = [count * i // workers for i in range(workers + 1)]
        futures = [self._executor(workers).submit(run, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        for future in futures:
            future.result()
