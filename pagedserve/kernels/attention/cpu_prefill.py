"""Native prefill attention on the CPU: one chunk's queries over its paged context, read in place.

`prefill_attention.cpp` runs a flash-style kernel over the block table (no gather, no K/V repeated per query
head, each KV head's query group stacked so a K/V tile is read once): bf16 on AMX tiles where the CPU has them,
otherwise fp32 vector code. The engine uses it where it beats SDPA (bf16 with AMX, `preferred`); elsewhere
`cpu.py` keeps the SDPA path, which this kernel's portable form matches for tests on any machine.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagedserve.kernels import native
from pagedserve.kernels.attention.reference import NO_MODS, ScoreMods
from pagedserve.kernels.native.fp8 import cache_dtype_code
from pagedserve.kernels.native.split import RangeSplitter

_kernel = native.Function(
    "pagedserve_prefill_attention",
    [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float]
    + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float],
    value_errors={2: "AMX prefill attention needs AMX-BF16, a bf16 cache and head_dim a multiple of 64"},
)
# A work item (one KV head, ~192 stacked query rows) is tens of microseconds or more: one per thread is enough.
_split = RangeSplitter("pagedserve-prefill", min_per_thread=1)
_ROWS_PER_ITEM = 384
# PAGEDSERVE_PREFILL_KERNEL=0 keeps SDPA for every prefill chunk (A/B runs).
ENV_SWITCH = "PAGEDSERVE_PREFILL_KERNEL"
_amx: bool | None = None


def amx_available() -> bool:
    """True where the native library was built for AMX-BF16 and the OS grants the tile state."""
    global _amx
    if _amx is None:
        library = native.load()
        _amx = bool(library is not None and library.pagedserve_prefill_attention_amx())
    return _amx


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when prefill_attention can run on these tensors (CPU fp32/bf16 query, contiguous caches of its dtype
    or fp8, widened as the tiles are packed)."""
    return (native.dtype_code(query) is not None and cache_dtype_code(key_cache, query) is not None
            and key_cache.is_contiguous() and native.load() is not None)


def preferred(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True where the engine should use this kernel rather than SDPA: bf16 on AMX (faster there)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return (query.dtype == torch.bfloat16 and query.shape[2] % 64 == 0 and supports(query, key_cache)
            and amx_available())


def prefill_attention(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    value_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks] int32, this sequence's block table
    seq_len: int,  # context length including the chunk; query i sits at seq_len - q_len + i
    scale: float,
    mods: ScoreMods = NO_MODS,
    use_amx: bool | None = None,  # None: AMX where available for bf16
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's k_scale, v_scale
) -> torch.Tensor:  # -> [q_len, Hq, D]
    """Causal attention of one chunk over its paged context (window and soft cap as in `mods`)."""
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if q_len > seq_len or seq_len > table.numel() * block_size:
        raise ValueError(f"a chunk of {q_len} queries at seq_len {seq_len} does not fit a table of "
                         f"{table.numel()} blocks of {block_size}")
    if use_amx is None:
        use_amx = query.dtype == torch.bfloat16 and head_dim % 64 == 0 and amx_available()
    query = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    table = table.to(torch.int32).contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    group = num_q_heads // num_kv_heads
    query_block = max(16, _ROWS_PER_ITEM // group)
    items = num_kv_heads * -(-q_len // query_block)
    code, cache_code = native.dtype_code(query), cache_dtype_code(key_cache, query)
    window, soft_cap = mods.sliding_window or 0, mods.soft_cap or 0.0
    k_scale, v_scale = kv_scales

    def run(begin: int, end: int) -> None:
        _kernel(out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), table.data_ptr(),
                q_len, seq_len, num_q_heads, num_kv_heads, head_dim, block_size, query.stride(0), out.stride(0),
                scale, window, soft_cap, query_block, begin, end, int(use_amx), code, cache_code, k_scale, v_scale)

    _split(run, items)
    return out
