"""Kernel benchmarks.

`python bench/kernel_bench.py cpu` times the engine's CPU attention (native in-place decode kernel, unpadded
prefill), the batched torch reference and a per-sequence loop (one gather and one SDPA per sequence),
per layer, and writes bench/results/kernels_cpu.json.
`python bench/kernel_bench.py linear` times the CPU linear layers of SmolLM2's shapes in fp32 and bf16, prepacked
for oneDNN where this CPU runs that dtype and plain F.linear otherwise, and writes
bench/results/linear_cpu.json: what `dtype auto` on the CPU decides from.
`python bench/kernel_bench.py gpu-check --out DIR` is what bench/gpu_check.sh runs on a GPU machine: kernel
correctness at real sizes, decode bandwidth, prefill TFLOP/s against SDPA, engine tokens/s
(bench/kernels_gpu.py). `--dry-run` runs it at tiny sizes on the CPU (TRITON_INTERPRET=1) to prove the wiring.
`python bench/kernel_bench.py aot` compiles every Triton kernel configuration for sm_90 without a GPU and
reports registers and spills (bench/results/kernels_aot_sm90.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_timing import LOG, REPO, bench_ms, log, paged_batch
from kernels_gpu import H200_PEAK_GBPS, run_gpu_check


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
    from pagedserve.kernels.attention import cpu as attention_cpu
    from pagedserve.kernels.attention import reference

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


# ------------------------------------------------------------------------- ahead-of-time compile


def _aot_launches() -> list:
    """Run every launcher on small CPU tensors with serving-like shapes, recording the kernels' launches."""
    from pagedserve.kernels.activation import triton as activation_triton
    from pagedserve.kernels.aot import record_launches
    from pagedserve.kernels.attention import triton as attention_triton
    from pagedserve.kernels.cache import triton as cache_triton
    from pagedserve.kernels.norm import triton as norm_triton
    from pagedserve.kernels.rope import triton as rope_triton

    bf16, cpu = torch.bfloat16, torch.device("cpu")
    modules = (attention_triton, cache_triton, rope_triton, norm_triton, activation_triton)
    with record_launches(*modules) as launches:
        # (query heads, KV heads, head size): Llama-3-8B, SmolLM2-135M, Qwen2-0.5B, head size 80, 256; each on a
        # bf16 and an fp8 (e4m3) KV cache, Llama-3-8B's also on e5m2.
        for i, (hq, hkv, d) in enumerate(((32, 8, 128), (9, 3, 64), (14, 2, 64), (32, 32, 80), (16, 8, 256))):
            for cache_dtype in (bf16, torch.float8_e4m3fn, torch.float8_e5m2)[: 3 if i == 0 else 2]:
                fp8 = {} if cache_dtype == bf16 else {"k_scale": 0.5, "v_scale": 0.25}
                for lens, splits in (([(1, 4096)] * 2, None), ([(1, 4096)] * 2, 8), ([(64, 1024), (1, 900)], None),
                                     ([(512, 512), (1, 900)], None)):
                    pa, _ = paged_batch(lens, hq, hkv, d, 16, bf16, cpu)
                    attention_triton.paged_attention(pa[0], pa[1].to(cache_dtype), pa[2].to(cache_dtype), *pa[3:],
                                                     num_splits=splits, **fp8)
                k = torch.randn(4, hkv, d, dtype=bf16)
                cache = torch.zeros(8, 16, hkv, d, dtype=cache_dtype)
                cache_triton.reshape_and_cache(k, k, cache, cache, torch.arange(4), **fp8)
                cache_triton.copy_blocks([cache], [cache], [(0, 1)])
                q = torch.randn(4, hq, d, dtype=bf16)
                rope_triton.rotary_embedding_and_cache(torch.arange(4), q, k, k, torch.randn(64, d), cache, cache,
                                                       torch.arange(4), **fp8)
            rope_triton.rotary_embedding(torch.arange(4), q, k, torch.randn(64, d, dtype=bf16))
        for hidden, inter in ((4096, 14336), (576, 1536)):
            x = torch.randn(4, hidden, dtype=bf16)
            norm_triton.rms_norm(x, torch.ones(hidden, dtype=bf16), 1e-5, x)
            norm_triton.rms_norm(x, torch.ones(hidden, dtype=bf16), 1e-5)
            activation_triton.silu_and_mul(torch.randn(4, 2 * inter, dtype=bf16))
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
    gpu.add_argument("--parts", default="correctness,decode,prefill,engine,kv8")
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
    failed = False in (report["all_correct"], report["kv8_all_correct"]) or any(isinstance(v, dict) and "error" in v for v in report.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
