"""What bench/kernel_bench.py and bench/kernels_gpu.py share: a log, a timer and paged-attention batches."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LOG: list[str] = []


def log(msg: str) -> None:
    """Print and keep a line for the log file."""
    print(msg, flush=True)
    LOG.append(msg)


DRY_RUN = False  # set by gpu-check --dry-run: every timing runs once, only to prove the wiring


def bench_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, rep: int = 10) -> float:
    """Median milliseconds of fn(); CUDA events on the GPU, perf_counter on the CPU."""
    if DRY_RUN:
        warmup, rep = 0, 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paged_batch(
    lens: list[tuple[int, int]],  # (q_len, seq_len) per sequence
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None = None,  # pool size; default just enough (+ slack)
    seed: int = 0,
) -> tuple[tuple, dict]:
    """paged_attention arguments with scattered block tables over the pool, plus byte/flop counts."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-k // block_size) for _, k in lens]
    needed = sum(blocks_per_seq)
    num_blocks = max(num_blocks or 0, needed + 8)
    perm = torch.randperm(num_blocks, generator=gen)[:needed]
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = perm[used : used + n].int()
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.empty(shape, dtype=dtype, device=device)
    value_cache = torch.empty(shape, dtype=dtype, device=device)
    # Only the blocks in use are filled: the pool may be larger than what is worth initialising.
    used_ids = perm.to(device).long()
    # Table padding points at block 0; the torch reference gathers it (masked), so it must hold finite values.
    key_cache[0].zero_()
    value_cache[0].zero_()
    key_cache[used_ids] = torch.randn(needed, *shape[1:], device=device).to(dtype)
    value_cache[used_ids] = torch.randn(needed, *shape[1:], device=device).to(dtype)
    q_lens = torch.tensor([q for q, _ in lens])
    query = torch.randn(int(q_lens.sum()), num_q_heads, head_dim, device=device).to(dtype)
    args = (query, key_cache, value_cache, tables.to(device),
            torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int().to(device),
            torch.tensor([k for _, k in lens], dtype=torch.int32, device=device),
            head_dim**-0.5, int(q_lens.max()), max(k for _, k in lens))
    elem = key_cache.element_size()
    kv_bytes = sum(k for _, k in lens) * num_kv_heads * head_dim * 2 * elem
    io_bytes = 2 * query.numel() * elem + tables.numel() * 4
    # Causal: query i of a chunk sees (context + i + 1) keys; two matmuls of 2 flops per MAC.
    flops = sum(4 * num_q_heads * head_dim * sum(k - q + i + 1 for i in range(q)) for q, k in lens)
    return args, {"bytes": kv_bytes + io_bytes, "flops": flops}
