"""The native kernels' codes for the KV cache's element type (fp8.h CacheDType): an fp8 cache beside a query."""

from __future__ import annotations

import torch

from pagedserve.kernels import native

# After the query dtypes' codes 0 (fp32) and 1 (bf16).
FP8_CACHE_CODES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def cache_dtype_code(cache: torch.Tensor, query: torch.Tensor) -> int | None:
    """The code of a CPU cache a kernel reads or writes beside this query: the query's own dtype, or an fp8
    format; None where the kernels do not serve it."""
    if cache.device.type != "cpu":
        return None
    if cache.dtype == query.dtype:
        return native.dtype_code(query)
    return FP8_CACHE_CODES.get(cache.dtype)
