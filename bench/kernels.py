"""Kernel benchmarks.

`python bench/kernels.py cpu` times the engine's CPU attention (native in-place decode kernel, unpadded
prefill), the batched torch reference and a per-sequence loop (one gather and one SDPA per sequence),
per layer, and writes bench/results/kernels_cpu.json.
`python bench/kernels.py linear` times the CPU linear layers of SmolLM2's shapes in fp32 and bf16, prepacked
for oneDNN where this CPU runs that dtype and plain F.linear otherwise, and writes
bench/results/linear_cpu.json: what `dtype auto` on the CPU decides from.
`python bench/kernels.py gpu-check --out DIR` is what bench/gpu_check.sh runs on a GPU machine: kernel
correctness at real sizes, decode bandwidth, prefill TFLOP/s against SDPA, engine tokens/s.
`--dry-run` runs gpu-check at tiny sizes on the CPU (TRITON_INTERPRET=1) to prove the wiring.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
H200_PEAK_GBPS = 4800.0  # vendor datasheet HBM3e bandwidth
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


def per_sequence_loop(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, *_):
    """The naive CPU path the batched reference replaced: a Python loop, one gather per sequence."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for s in range(seq_lens.numel()):
        start, end, seq_len = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(seq_lens[s])
        blocks = block_tables[s, : -(-seq_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, 0)
        v = value_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, 0)
        q = query[start:end].transpose(0, 1)
        mask = torch.ones(end - start, seq_len, dtype=torch.bool).tril(seq_len - (end - start))
        out[start:end] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def run_cpu(args: argparse.Namespace) -> dict:
    """Per-layer attention time of the CPU paths, SmolLM2-135M heads (9 query, 3 KV, D 64), block 16."""
    from pagedserve.kernels import attention_cpu, reference

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    rows = []
    heads = (9, 3, 64)
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in ((1, 512), (8, 512), (32, 512), (32, 2048), (128, 512)):
            lens = [(1, context - 7 * (i % 5)) for i in range(batch)]
            pa, counts = paged_batch(lens, *heads, 16, dtype, device)
            row = {"phase": "decode", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                   "context": context}
            for name, fn in (("engine_cpu_ms", attention_cpu.paged_attention), ("reference_ms", reference.paged_attention),
                             ("per_sequence_ms", per_sequence_loop)):
                row[name] = round(bench_ms(lambda fn=fn, pa=pa: fn(*pa), device, 2, args.rep), 3)
            row["speedup_vs_per_sequence"] = round(row["per_sequence_ms"] / row["reference_ms"], 2)
            row["engine_speedup_vs_reference"] = round(row["reference_ms"] / row["engine_cpu_ms"], 2)
            rows.append(row)
            log(json.dumps(row))
        for num, q_len, context, decodes in ((4, 128, 512, 16), (1, 512, 512, 16), (8, 64, 1024, 16),
                                             (1, 1024, 1024, 0), (1, 512, 1536, 0)):
            lens = [(q_len, context)] * num + [(1, context)] * decodes
            pa, counts = paged_batch(lens, *heads, 16, dtype, device)
            row = {"phase": "mixed" if decodes else "prefill", "dtype": str(dtype).removeprefix("torch."),
                   "prefill_chunks": num, "chunk": q_len, "context": context, "decodes": decodes}
            row["engine_cpu_ms"] = round(bench_ms(lambda pa=pa: attention_cpu.paged_attention(*pa), device, 1,
                                                  args.rep), 3)
            row["reference_ms"] = round(bench_ms(lambda pa=pa: reference.paged_attention(*pa), device, 1, args.rep),
                                        3)
            row["engine_speedup_vs_reference"] = round(row["reference_ms"] / row["engine_cpu_ms"], 2)
            row["per_sequence_ms"] = round(bench_ms(lambda pa=pa: per_sequence_loop(*pa), device, 1, args.rep), 3)
            row["speedup_vs_per_sequence"] = round(row["per_sequence_ms"] / row["reference_ms"], 2)
            rows.append(row)
            log(json.dumps(row))
    return {"machine": platform.processor() or platform.machine(), "threads": args.threads,
            "torch": torch.__version__, "rows": rows}


def run_linear(args: argparse.Namespace) -> dict:
    """Median ms of SmolLM2-135M's linear layers (hidden 576, MLP 1536, vocab 49152) at a few row counts:
    fp32 packed and plain, bf16 packed (where oneDNN runs bf16 here) and plain."""
    from pagedserve.backend.model.cpu_linear import PackedLinear, can_prepack

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    torch.manual_seed(0)
    shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
              "lm_head": (576, 49152)}
    rows = []
    with torch.inference_mode():
        for name, (n_in, n_out) in shapes.items():
            for num_rows in (1, 8, 64, 256):
                row = {"layer": name, "in": n_in, "out": n_out, "rows": num_rows}
                for dtype in (torch.float32, torch.bfloat16):
                    tag = str(dtype).removeprefix("torch.")
                    linear = torch.nn.Linear(n_in, n_out, bias=False).to(dtype)
                    x = torch.randn(num_rows, n_in, dtype=dtype)
                    row[f"{tag}_plain_ms"] = round(bench_ms(lambda lin=linear, x=x: lin(x), device, 2, args.rep), 3)
                    if can_prepack(dtype):
                        packed = PackedLinear(linear, 64)
                        row[f"{tag}_packed_ms"] = round(bench_ms(lambda p=packed, x=x: p(x), device, 2, args.rep), 3)
                    else:
                        row[f"{tag}_packed_ms"] = None
                best = {tag: min(v for k, v in row.items() if k.startswith(tag) and v is not None)
                        for tag in ("float32", "bfloat16")}
                row["bf16_over_fp32"] = round(best["bfloat16"] / best["float32"], 2)
                rows.append(row)
                log(json.dumps(row))
    return {"machine": platform.processor() or platform.machine(), "threads": args.threads,
            "torch": torch.__version__, "bf16_packed": can_prepack(torch.bfloat16), "rows": rows}


# ---------------------------------------------------------------------------------------- gpu check


def _check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> dict:
    """Compare in fp32 and record the worst error; never raises, so one failure doesn't hide the rest."""
    diff = (got.float() - want.float()).abs()
    ok = bool(torch.all(diff <= atol + rtol * want.float().abs()).item()) and not bool(got.isnan().any())
    res = {"name": name, "ok": ok, "max_abs_err": float(diff.max()) if diff.numel() else 0.0,
           "atol": atol, "rtol": rtol}
    log(f"  {'PASS' if ok else 'FAIL'} {name}: max abs err {res['max_abs_err']:.3g}")
    return res


def _replay_in_cuda_graph(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Capture fn (after a warm-up on a side stream, as CUDA graphs require) and return one replay's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out


def gpu_correctness(device: torch.device, dry: bool) -> list[dict]:
    """Every Triton kernel against its torch reference at serving sizes (tiny sizes in a dry run)."""
    from pagedserve.kernels import attention_triton, cache_triton, elementwise_triton, reference
    from pagedserve.kernels.rope_cache import compute_cos_sin_cache

    bf16 = torch.bfloat16
    results = []
    # Attention in fp32 for the reference (exact); the kernel reads the same bf16 cache.
    shapes = [(32, 8, 128, 16), (14, 2, 64, 16), (32, 32, 80, 32), (16, 2, 256, 16)]
    if dry:
        shapes = [(4, 2, 64, 16), (8, 1, 80, 32)]
    for hq, hkv, d, bs in shapes:
        lens = ([(512, 2048), (1, 4000), (37, 37), (1, 1), (300, 1500)] + [(1, 700 + 13 * i) for i in range(24)]
                if not dry else [(9, 30), (1, 20), (1, 1)])
        pa, _ = paged_batch(lens, hq, hkv, d, bs, bf16, device, seed=d)
        want = reference.paged_attention(pa[0].float(), pa[1].float(), pa[2].float(), *pa[3:])
        got = attention_triton.paged_attention(*pa)
        results.append(_check(f"paged_attention mixed Hq={hq} Hkv={hkv} D={d} BS={bs}", got, want, 2e-2, 2e-2))
        decode = [(1, k) for _, k in lens]
        pd, _ = paged_batch(decode, hq, hkv, d, bs, bf16, device, seed=d + 1)
        want = reference.paged_attention(pd[0].float(), pd[1].float(), pd[2].float(), *pd[3:])
        for splits in (None, 1, 8):
            got = attention_triton.paged_attention(*pd, num_splits=splits)
            results.append(_check(f"paged_attention decode splits={splits} Hq={hq} Hkv={hkv} D={d}", got, want,
                                  2e-2, 2e-2))
        if device.type == "cuda":
            for splits in (1, 8):
                got = _replay_in_cuda_graph(lambda s=splits, pd=pd: attention_triton.paged_attention(*pd, num_splits=s))
                results.append(_check(f"paged_attention decode in a CUDA graph splits={splits} D={d}", got, want,
                                      2e-2, 2e-2))
    # A pool past 2**31 elements with the far blocks in use: int64 addressing at real scale.
    per_block = 16 * 8 * 128
    big_blocks = 2**31 // per_block + 1024 if not dry else 64
    lens = [(1, 3000), (1, 4096), (64, 2048)] if not dry else [(1, 20), (3, 9)]
    pa, _ = paged_batch(lens, 32, 8, 128, 16, bf16, device, num_blocks=big_blocks, seed=7)
    for s, (_, seq_len) in enumerate(lens):  # each sequence's last block moves to the far end of the pool
        far = big_blocks - 1 - s
        pa[3][s, (seq_len - 1) // 16] = far
        pa[1][far].normal_()
        pa[2][far].normal_()
    want = reference.paged_attention(pa[0].float(), pa[1].float(), pa[2].float(), *pa[3:])
    results.append(_check(f"paged_attention pool of {big_blocks} blocks (int64 offsets)",
                          attention_triton.paged_attention(*pa), want, 2e-2, 2e-2))
    del pa, want

    tokens, hkv, d = (4096, 8, 128) if not dry else (17, 2, 64)
    key, value = torch.randn(tokens, hkv, d, device=device, dtype=bf16), torch.randn(tokens, hkv, d, device=device,
                                                                                     dtype=bf16)
    nb = tokens // 16 + 64
    slots = torch.randperm(nb * 16, device=device)[:tokens]
    slots[::97] = -1
    caches = [torch.zeros(nb, 16, hkv, d, device=device, dtype=bf16) for _ in range(4)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    cache_triton.reshape_and_cache(key, value, caches[2], caches[3], slots)
    results.append(_check("reshape_and_cache", torch.stack(caches[2:]), torch.stack(caches[:2]), 0, 0))
    mapping = [(i, nb - 1 - i) for i in range(8)]
    reference.copy_blocks([caches[0]], [caches[1]], mapping)
    cache_triton.copy_blocks([caches[2]], [caches[3]], mapping)
    results.append(_check("copy_blocks", torch.stack(caches[2:]), torch.stack(caches[:2]), 0, 0))

    cos_sin = compute_cos_sin_cache(d, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}, bf16, device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    q = torch.randn(tokens, 4 * hkv, d, device=device, dtype=bf16)
    got, want = elementwise_triton.rotary_embedding(positions, q, key, cos_sin), reference.rotary_embedding(
        positions, q, key, cos_sin)
    # bf16 outputs: up to two bf16 steps apart (the interpreter truncates where the GPU rounds).
    results.append(_check("rotary_embedding q", got[0], want[0], 4e-2, 1.6e-2))
    results.append(_check("rotary_embedding k", got[1], want[1], 4e-2, 1.6e-2))
    hidden = 4096 if not dry else 96
    x = torch.randn(tokens, hidden, device=device, dtype=bf16)
    res = torch.randn(tokens, hidden, device=device, dtype=bf16)
    w = torch.randn(hidden, device=device, dtype=bf16)
    out, summed = elementwise_triton.rms_norm(x, w, 1e-5, res)
    ref_out, ref_summed = reference.rms_norm(x, w, 1e-5, res)
    results.append(_check("rms_norm + residual", out, ref_out, 4e-2, 1.6e-2))
    results.append(_check("rms_norm residual sum", summed, ref_summed, 4e-2, 1.6e-2))
    gate_up = torch.randn(tokens, 2 * (14336 if not dry else 100), device=device, dtype=bf16)
    results.append(_check("silu_and_mul", elementwise_triton.silu_and_mul(gate_up),
                          reference.silu_and_mul(gate_up), 4e-2, 1.6e-2))
    return results


def gpu_decode_bandwidth(device: torch.device, dry: bool, peak_gbps: float) -> list[dict]:
    """Decode attention achieved bandwidth (K/V bytes read / time); Llama-3-8B heads (32 q, 8 KV, D 128)."""
    from pagedserve.kernels import attention_triton, reference

    cases = [(64, 4096), (256, 1024), (8, 32768), (1, 32768)] if not dry else [(4, 64), (8, 32)]
    rows = []
    for batch, context in cases:
        lens = [(1, context)] * batch
        pa, counts = paged_batch(lens, 32, 8, 128, 16, torch.bfloat16, device, seed=batch)
        row = {"batch": batch, "context": context, "bytes": counts["bytes"]}
        for label, splits in (("heuristic", None), ("no_split", 1)):
            ms = bench_ms(lambda s=splits, pa=pa: attention_triton.paged_attention(*pa, num_splits=s), device,
                          3, 5 if dry else 20)
            gbps = counts["bytes"] / ms / 1e6
            row[f"{label}_ms"] = round(ms, 4)
            row[f"{label}_GBps"] = round(gbps, 1)
            row[f"{label}_pct_of_peak"] = round(100 * gbps / peak_gbps, 1)
        ref_ms = bench_ms(lambda pa=pa: reference.paged_attention(*pa), device, 1, 3 if dry else 5)
        row["torch_reference_ms"] = round(ref_ms, 4)
        rows.append(row)
        log(f"  decode B={batch} ctx={context}: {row['heuristic_GBps']} GB/s ({row['heuristic_pct_of_peak']}% of "
            f"{peak_gbps:.0f}), no split {row['no_split_GBps']} GB/s; torch reference {ref_ms:.3f} ms")
    return rows


def gpu_prefill_vs_sdpa(device: torch.device, dry: bool) -> list[dict]:
    """Whole-prompt causal prefill: the paged kernel's TFLOP/s against SDPA on the same shapes."""
    from pagedserve.kernels import attention_triton

    cases = [(4, 2048), (1, 8192), (16, 512)] if not dry else [(2, 48)]
    rows = []
    for batch, length in cases:
        lens = [(length, length)] * batch
        pa, counts = paged_batch(lens, 32, 8, 128, 16, torch.bfloat16, device, seed=length)
        query = pa[0]
        # SDPA gets dense [B, H, L, D] tensors with K/V already expanded to the query heads: its best case.
        q = query.view(batch, length, 32, 128).transpose(1, 2).contiguous()
        k = torch.randn(batch, 32, length, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        rep = 3 if dry else 10
        ours = bench_ms(lambda pa=pa: attention_triton.paged_attention(*pa), device, 2, rep)
        sdpa = bench_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True), device,
                        2, rep)
        row = {"batch": batch, "length": length, "flops": counts["flops"],
               "triton_ms": round(ours, 4), "sdpa_ms": round(sdpa, 4),
               "triton_TFLOPs": round(counts["flops"] / ours / 1e9, 1),
               "sdpa_TFLOPs": round(counts["flops"] / sdpa / 1e9, 1)}
        row["ratio_vs_sdpa"] = round(sdpa / ours, 3)
        rows.append(row)
        log(f"  prefill B={batch} L={length}: {row['triton_TFLOPs']} TFLOP/s vs SDPA {row['sdpa_TFLOPs']} "
            f"({row['ratio_vs_sdpa']}x)")
    return rows


def copy_bandwidth(device: torch.device, dry: bool) -> float:
    """Measured device-to-device copy GB/s (bytes read + written), the practical ceiling."""
    n = (1 << 30) if not dry else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, 3, 10)
    return 2 * n / ms / 1e6


def engine_throughput(device: torch.device, dry: bool, model: str | None, workdir: Path) -> dict:
    """Offline generate() output tokens/s; SmolLM2-135M if found, else a random model of its shape."""
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    source = "given"
    # The interpreter emulates bf16 bit by bit, far too slowly for a whole model: the dry run uses fp32.
    dtype = "float32" if dry else "bfloat16"
    if model is None and not dry:
        from pagedserve.backend.worker.default_model import default_model_dir, is_prepared

        candidate = default_model_dir()
        if is_prepared(candidate):
            model, source = str(candidate), "SmolLM2-135M-Instruct (converted default model)"
    if model is None:
        from pagedserve.testing import make_tiny_model

        # SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, MLP 1536, tied); the tiny tokenizer's
        # 384-token vocabulary replaces its 49152, so the lm_head is cheaper than the real model's.
        shape = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                     tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=100000.0)
        source = "random weights in SmolLM2-135M's shape (vocab 384)"
        if dry:
            shape.update(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
            source = "tiny random model (dry run)"
        model = str(make_tiny_model(workdir / "smollm2-shaped", "llama", dtype=dtype, **shape))
    num_prompts, new_tokens, prompt_len = (64, 128, 32) if not dry else (2, 3, 5)
    engine = LLMEngine.from_pretrained(model, dtype=dtype, device=device.type,
                                       max_num_seqs=num_prompts, max_num_batched_tokens=4096 if not dry else 64,
                                       max_model_len=2048 if not dry else 128,
                                       **({"num_blocks": 64} if dry else {}))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(prompt_len + i % 17)] for i in range(num_prompts)]

    def run() -> int:
        for i, ids in enumerate(prompts):
            engine.add_request(f"p{i}-{time.monotonic_ns()}", None, params, prompt_token_ids=ids)
        produced = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    produced += len(out.outputs[0].token_ids)
        return produced

    run()  # warm-up: Triton compiles, allocator settles
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    produced = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    res = {"model": source, "dtype": dtype, "prompts": num_prompts, "new_tokens_each": new_tokens, "output_tokens": produced,
           "seconds": round(seconds, 3), "output_tokens_per_s": round(produced / seconds, 1)}
    log(f"  engine: {res['output_tokens_per_s']} output tokens/s ({source})")
    return res


def _section(report: dict, key: str, fn: Callable[[], object]) -> None:
    """Run one part of the check; a failure is recorded and the rest still run."""
    log(f"== {key}")
    t0 = time.perf_counter()
    try:
        report[key] = fn()
    except Exception as exc:  # noqa: BLE001 - the report must survive any one part failing
        report[key] = {"error": f"{type(exc).__name__}: {exc}"}
        log(traceback.format_exc())
    log(f"   ({time.perf_counter() - t0:.1f} s)")


def run_gpu_check(args: argparse.Namespace) -> dict:
    """Correctness, decode bandwidth, prefill vs SDPA and engine throughput, each section isolated."""
    import triton

    global DRY_RUN
    dry = DRY_RUN = args.dry_run
    if dry:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--dry-run needs TRITON_INTERPRET=1 (gpu_check.sh sets it)"
        device = torch.device("cpu")
    else:
        assert torch.cuda.is_available(), "gpu-check needs a CUDA device (use --dry-run on a CPU)"
        device = torch.device("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": dry, "torch": torch.__version__, "triton": triton.__version__,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"}
    parts = set(args.parts.split(","))
    if "correctness" in parts:
        _section(report, "correctness", lambda: gpu_correctness(device, dry))
    if "decode" in parts:
        _section(report, "copy_GBps", lambda: round(copy_bandwidth(device, dry), 1))
        _section(report, "decode", lambda: gpu_decode_bandwidth(device, dry, args.peak_gbps))
    if "prefill" in parts:
        _section(report, "prefill", lambda: gpu_prefill_vs_sdpa(device, dry))
    if "engine" in parts:
        _section(report, "engine", lambda: engine_throughput(device, dry, args.model, out_dir))
    checks = report.get("correctness")
    report["all_correct"] = all(c["ok"] for c in checks) if isinstance(checks, list) else None
    decode = report.get("decode")
    if isinstance(decode, list) and decode:
        report["decode_target_70pct_met"] = all(r["heuristic_pct_of_peak"] >= 70 for r in decode[:2])
    prefill = report.get("prefill")
    if isinstance(prefill, list) and prefill:
        report["prefill_target_0.8x_sdpa_met"] = all(r["ratio_vs_sdpa"] >= 0.8 for r in prefill)
    return report


# ------------------------------------------------------------------------- ahead-of-time compile


def _aot_launches() -> list:
    """Run every launcher on small CPU tensors with serving-like shapes, recording the kernels' launches."""
    from pagedserve.kernels import attention_triton, cache_triton, elementwise_triton
    from pagedserve.kernels.aot import record_launches

    bf16, cpu = torch.bfloat16, torch.device("cpu")
    with record_launches(attention_triton, cache_triton, elementwise_triton) as launches:
        # (query heads, KV heads, head size): Llama-3-8B, SmolLM2-135M, Qwen2-0.5B, head size 80, 256.
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64), (14, 2, 64), (32, 32, 80), (16, 8, 256)):
            for lens, splits in (([(1, 4096)] * 2, None), ([(1, 4096)] * 2, 8), ([(64, 1024), (1, 900)], None),
                                 ([(512, 512), (1, 900)], None)):
                pa, _ = paged_batch(lens, hq, hkv, d, 16, bf16, cpu)
                attention_triton.paged_attention(*pa, num_splits=splits)
            q, k = torch.randn(4, hq, d, dtype=bf16), torch.randn(4, hkv, d, dtype=bf16)
            elementwise_triton.rotary_embedding(torch.arange(4), q, k, torch.randn(64, d, dtype=bf16))
            cache = torch.zeros(8, 16, hkv, d, dtype=bf16)
            cache_triton.reshape_and_cache(k, k, cache, cache, torch.arange(4))
            cache_triton.copy_blocks([cache], [cache], [(0, 1)])
        for hidden, inter in ((4096, 14336), (576, 1536)):
            x = torch.randn(4, hidden, dtype=bf16)
            elementwise_triton.rms_norm(x, torch.ones(hidden, dtype=bf16), 1e-5, x)
            elementwise_triton.rms_norm(x, torch.ones(hidden, dtype=bf16), 1e-5)
            elementwise_triton.silu_and_mul(torch.randn(4, 2 * inter, dtype=bf16))
    return launches


def run_aot(args: argparse.Namespace) -> dict:
    """Compile every launch configuration for sm_<arch> without a GPU; report registers and spills."""
    import triton
    from pagedserve.kernels.aot import SM90_MAX_SHARED_BYTES, compile_launch, specialise

    rows, seen = [], set()
    for launch in _aot_launches():
        signature, constexprs, _, options = specialise(launch)
        key = (launch.fn.__name__, repr(sorted(signature.items())),
               repr(sorted((k, str(v)) for k, v in constexprs.items())), repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        try:
            row = compile_launch(launch, args.arch)
        except Exception as exc:  # noqa: BLE001 - one failing configuration is a finding, not a crash
            row = {"kernel": launch.fn.__name__, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        log(json.dumps(row))
    # Any stack use in these kernels means register spills.
    ok = all("error" not in r and r["shared_bytes"] <= SM90_MAX_SHARED_BYTES and r["stack_bytes"] == 0 for r in rows)
    return {"target": f"sm_{args.arch}", "triton": triton.__version__, "all_fit_without_spills": ok,
            "configs": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu", help="torch reference paths on the CPU")
    # One thread by default: these shared 2-core machines are often loaded, and oversubscribed OpenMP
    # barriers make multi-threaded timings erratic.
    cpu.add_argument("--threads", type=int, default=1)
    cpu.add_argument("--rep", type=int, default=5)
    cpu.add_argument("--out", default=str(REPO / "bench" / "results" / "kernels_cpu.json"))
    linear = sub.add_parser("linear", help="CPU linear layers, fp32 vs bf16, packed vs plain")
    linear.add_argument("--threads", type=int, default=1)
    linear.add_argument("--rep", type=int, default=10)
    linear.add_argument("--out", default=str(REPO / "bench" / "results" / "linear_cpu.json"))
    gpu = sub.add_parser("gpu-check", help="the GPU check (bench/gpu_check.sh runs it)")
    gpu.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.log")
    gpu.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    gpu.add_argument("--parts", default="correctness,decode,prefill,engine")
    gpu.add_argument("--model", default=None, help="model folder for the engine part (default: SmolLM2 if found)")
    gpu.add_argument("--peak-gbps", type=float, default=H200_PEAK_GBPS)
    aot = sub.add_parser("aot", help="compile every kernel configuration for a GPU target, no GPU needed")
    aot.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    aot.add_argument("--out", default=str(REPO / "bench" / "results" / "kernels_aot_sm90.json"))
    args = parser.parse_args()

    if args.mode == "aot":
        report = run_aot(args)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.out}; all_fit_without_spills={report['all_fit_without_spills']}")
        return 0 if report["all_fit_without_spills"] else 1

    if args.mode in ("cpu", "linear"):
        report = run_cpu(args) if args.mode == "cpu" else run_linear(args)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.out}")
        return 0
    report = run_gpu_check(args)
    out_dir = Path(args.out)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "gpu_check.log").write_text("\n".join(LOG) + "\n")
    log(f"wrote {out_dir / 'gpu_check.json'}; all_correct={report['all_correct']}")
    failed = report["all_correct"] is False or any(isinstance(v, dict) and "error" in v for v in report.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
