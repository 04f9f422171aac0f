"""The GPU check behind `python bench/kernel_bench.py gpu-check` (bench/gpu_check.sh runs it on a GPU machine).

Kernel correctness at real sizes, decode bandwidth, prefill TFLOP/s against SDPA, engine tokens/s; with
`--dry-run`, tiny sizes on the CPU under TRITON_INTERPRET=1, to prove the wiring.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import kernel_timing
import torch
import torch.nn.functional as F
from gpu_kv8 import kv8_checks, kv8_decode_time
from kernel_timing import bench_ms, log, paged_batch

H200_PEAK_GBPS = 4800.0  # vendor datasheet HBM3e bandwidth


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


def _attention_checks(device: torch.device, dry: bool) -> list[dict]:
    """Paged attention (mixed, decode with and without splits, in a CUDA graph, a pool past 2**31 elements)."""
    from pagedserve.kernels.attention import reference
    from pagedserve.kernels.attention import triton as attention_triton

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
    return results


def _image_ranges(lens: list[tuple[int, int]], runs: dict[int, tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[T, 2] bidirectional ranges: a query inside its sequence's image run [a, b) sees the run, others [0, 0)."""
    rows = []
    for s, (q_len, seq_len) in enumerate(lens):
        a, b = runs.get(s, (0, 0))
        rows += [(a, b) if a <= pos < b else (0, 0) for pos in range(seq_len - q_len, seq_len)]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _bidirectional_checks(device: torch.device, dry: bool) -> list[dict]:
    """Gemma 3's image runs (256 tokens, seen both ways) through the prefill tiles: a run inside a chunk after a
    prefix, one in a fresh prompt, one cut by its chunk's start, beside decodes; full and sliding layers."""
    from pagedserve.kernels.attention import reference
    from pagedserve.kernels.attention import triton as attention_triton

    hq, hkv, d, bs = (8, 4, 256, 16) if not dry else (4, 2, 64, 16)
    lens = [(512, 1024), (1, 3000), (300, 300), (1, 700), (260, 2000)] if not dry else [(9, 30), (1, 20), (6, 6)]
    runs = {0: (600, 856), 2: (10, 266), 4: (1700, 1956)} if not dry else {0: (22, 28), 2: (1, 5)}
    pa, _ = paged_batch(lens, hq, hkv, d, bs, torch.bfloat16, device, seed=31)
    ranges = _image_ranges(lens, runs, device)
    results = []
    for window in (None, 1024 if not dry else 4):
        want = reference.paged_attention(pa[0].float(), pa[1].float(), pa[2].float(), *pa[3:],
                                         sliding_window=window, bidirectional_ranges=ranges)
        got = attention_triton.paged_attention(*pa, sliding_window=window, bidirectional_ranges=ranges)
        results.append(_check(f"paged_attention image runs window={window} Hq={hq} Hkv={hkv} D={d}", got, want,
                              2e-2, 2e-2))
    return results


def _row_checks(device: torch.device, dry: bool) -> list[dict]:
    """The cache writes (bit-exact), rotary embedding, RMSNorm and SiLU-and-mul at serving sizes."""
    from pagedserve.kernels.activation import reference as activation_reference
    from pagedserve.kernels.activation import triton as activation_triton
    from pagedserve.kernels.cache import reference as cache_reference
    from pagedserve.kernels.cache import triton as cache_triton
    from pagedserve.kernels.norm import reference as norm_reference
    from pagedserve.kernels.norm import triton as norm_triton
    from pagedserve.kernels.rope import compute_cos_sin_cache
    from pagedserve.kernels.rope import reference as rope_reference
    from pagedserve.kernels.rope import triton as rope_triton

    bf16 = torch.bfloat16
    results = []
    tokens, hkv, d = (4096, 8, 128) if not dry else (17, 2, 64)
    key, value = torch.randn(tokens, hkv, d, device=device, dtype=bf16), torch.randn(tokens, hkv, d, device=device,
                                                                                     dtype=bf16)
    nb = tokens // 16 + 64
    slots = torch.randperm(nb * 16, device=device)[:tokens]
    slots[::97] = -1
    caches = [torch.zeros(nb, 16, hkv, d, device=device, dtype=bf16) for _ in range(4)]
    cache_reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    cache_triton.reshape_and_cache(key, value, caches[2], caches[3], slots)
    results.append(_check("reshape_and_cache", torch.stack(caches[2:]), torch.stack(caches[:2]), 0, 0))
    mapping = [(i, nb - 1 - i) for i in range(8)]
    cache_reference.copy_blocks([caches[0]], [caches[1]], mapping)
    cache_triton.copy_blocks([caches[2]], [caches[3]], mapping)
    results.append(_check("copy_blocks", torch.stack(caches[2:]), torch.stack(caches[:2]), 0, 0))

    cos_sin = compute_cos_sin_cache(d, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}, bf16, device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    q = torch.randn(tokens, 4 * hkv, d, device=device, dtype=bf16)
    got, want = rope_triton.rotary_embedding(positions, q, key, cos_sin), rope_reference.rotary_embedding(
        positions, q, key, cos_sin)
    # bf16 outputs: up to two bf16 steps apart (the interpreter truncates where the GPU rounds).
    results.append(_check("rotary_embedding q", got[0], want[0], 4e-2, 1.6e-2))
    results.append(_check("rotary_embedding k", got[1], want[1], 4e-2, 1.6e-2))
    hidden = 4096 if not dry else 96
    x = torch.randn(tokens, hidden, device=device, dtype=bf16)
    res = torch.randn(tokens, hidden, device=device, dtype=bf16)
    w = torch.randn(hidden, device=device, dtype=bf16)
    out, summed = norm_triton.rms_norm(x, w, 1e-5, res)
    ref_out, ref_summed = norm_reference.rms_norm(x, w, 1e-5, res)
    results.append(_check("rms_norm + residual", out, ref_out, 4e-2, 1.6e-2))
    results.append(_check("rms_norm residual sum", summed, ref_summed, 4e-2, 1.6e-2))
    gate_up = torch.randn(tokens, 2 * (14336 if not dry else 100), device=device, dtype=bf16)
    results.append(_check("silu_and_mul", activation_triton.silu_and_mul(gate_up),
                          activation_reference.silu_and_mul(gate_up), 4e-2, 1.6e-2))
    return results


def _quant_weight(n: int, k: int, bits: int, group_size: int, device: torch.device):
    """A random W8A16 (per channel) or W4A16 (groups, with offsets) weight on `device`."""
    from pagedserve.kernels import quant_linear as ql

    dense = torch.randn(n, k, device=device) * 0.02
    weight = ql.quantize_int8(dense) if bits == 8 else ql.quantize_int4(dense, group_size)
    return weight.to(device)


def _quant_linear_checks(device: torch.device, dry: bool) -> list[dict]:
    """W8A16 / W4A16 dequantize-in-the-GEMM against dequantize-then-F.linear, decode and prefill rows, bf16;
    each check also times the kernel against bf16 F.linear on the dense weight."""
    from pagedserve.kernels.quant_linear import reference
    from pagedserve.kernels.quant_linear import triton as quant_triton

    n, k = (4096, 4096) if not dry else (48, 96)
    results = []
    for bits, group_size in ((8, k), (4, 128), (4, 32)):
        weight = _quant_weight(n, k, bits, group_size if not dry else 32, device)
        dense = weight.dequantize(torch.bfloat16)
        for m in (1, 7, 64, 512) if not dry else (1, 7):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = reference.quant_linear(x, weight)
            res = _check(f"quant_linear W{bits}A16 group={weight.group_size} M={m} N={n} K={k}",
                         quant_triton.quant_linear(x, weight), want, 2e-2, 2e-2)
            reps = 3 if dry else 20
            res["triton_ms"] = round(bench_ms(lambda x=x, w=weight: quant_triton.quant_linear(x, w), device, 2, reps), 4)
            res["bf16_dense_ms"] = round(bench_ms(lambda x=x, d=dense: F.linear(x, d), device, 2, reps), 4)
            log(f"    {res['triton_ms']} ms (bf16 dense F.linear {res['bf16_dense_ms']} ms)")
            results.append(res)
    return results


def _bitmask_checks(device: torch.device, dry: bool) -> list[dict]:
    """The structured-output grammar mask on fp32 logits, 32 of 64 rows, against the torch reference, timed."""
    from pagedserve.kernels.bitmask import reference
    from pagedserve.kernels.bitmask import triton as bitmask_triton

    rows_total, vocab = (64, 151936) if not dry else (4, 100)
    logits = torch.randn(rows_total, vocab, device=device)
    rows = torch.arange(0, rows_total, 2, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows.numel(), (vocab + 31) // 32), dtype=torch.int64,
                            device=device).to(torch.int32)
    want, got = logits.clone(), logits.clone()
    reference.apply_token_bitmask(want, bitmask, rows)
    bitmask_triton.apply_token_bitmask(got, bitmask, rows)
    # Masked entries are -inf on both sides (their difference is NaN), so the check is equality.
    name = f"apply_token_bitmask R={rows.numel()} V={vocab}"
    res = {"name": name, "ok": bool(torch.equal(got, want)), "max_abs_err": 0.0, "atol": 0, "rtol": 0}
    log(f"  {'PASS' if res['ok'] else 'FAIL'} {name}")
    reps = 3 if dry else 50
    res["triton_ms"] = round(bench_ms(lambda: bitmask_triton.apply_token_bitmask(logits, bitmask, rows),
                                      device, 2, reps), 4)
    log(f"    {res['triton_ms']} ms")
    return [res]


def _lora_checks(device: torch.device, dry: bool) -> list[dict]:
    """Multi-LoRA shrink + expand (4 adapters and base rows mixed, bf16) against the torch reference: decode
    rows unsorted, replayed from a CUDA graph; prefill rows with precomputed groups. Timed against the base
    layer's bf16 F.linear."""
    from pagedserve.kernels.lora import group_slots, reference
    from pagedserve.kernels.lora import triton as lora_triton

    k, n = (4096, 4096) if not dry else (96, 80)
    results = []
    for rank in (16, 64) if not dry else (16,):
        a = torch.randn(4, rank, k, device=device, dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(4, n, rank, device=device, dtype=torch.bfloat16) / rank ** 0.5
        for tokens in (32, 1024) if not dry else (5, 70):
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            slots = torch.randint(-1, 4, (tokens,), device=device)
            groups = group_slots(slots) if tokens > 64 else None
            base = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
            want = base.clone()
            reference.lora_expand_add(want, reference.lora_shrink(x, a, slots), b, slots)

            def delta(x=x, a=a, b=b, slots=slots, groups=groups, base=base) -> torch.Tensor:
                out = base.clone()
                lora_triton.lora_expand_add(out, lora_triton.lora_shrink(x, a, slots, groups), b, slots, 0, groups)
                return out

            got = _replay_in_cuda_graph(delta) if device.type == "cuda" and groups is None else delta()
            results.append(_check(f"lora shrink+expand T={tokens} K={k} N={n} R={rank} S=4", got, want, 3e-2, 2e-2))
            reps = 3 if dry else 50
            dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            results[-1]["triton_ms"] = round(bench_ms(delta, device, 2, reps), 4)
            results[-1]["base_linear_ms"] = round(bench_ms(lambda x=x, d=dense: F.linear(x, d), device, 2, reps), 4)
            log(f"    {results[-1]['triton_ms']} ms (base bf16 F.linear {results[-1]['base_linear_ms']} ms)")
    return results


def _moe_checks(device: torch.device, dry: bool) -> list[dict]:
    """The fused MoE forward (bf16) against the per-expert torch reference in Mixtral-8x7B's and Qwen3-30B-A3B's
    expert shapes, decode to prefill rows, each timed against the reference."""
    from pagedserve.kernels.moe import reference
    from pagedserve.kernels.moe import triton as moe_triton

    shapes = [(4096, 14336, 8, 2), (2048, 768, 128, 8)] if not dry else [(64, 32, 4, 2), (32, 16, 16, 4)]
    results = []
    for hidden, inter, experts, top_k in shapes:
        w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) / inter ** 0.5
        for tokens in (1, 16, 512) if not dry else (1, 9):
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            weights, ids = reference.topk_routing(torch.randn(tokens, experts, device=device), top_k, True)
            want = reference.fused_moe(x, w13, w2, weights, ids)
            res = _check(f"fused_moe E={experts} top{top_k} T={tokens} H={hidden} I={inter}",
                         moe_triton.fused_moe(x, w13, w2, weights, ids), want, 4e-2 * float(want.abs().max()), 0)
            reps = 3 if dry else 20
            args = (x, w13, w2, weights, ids)
            res["triton_ms"] = round(bench_ms(lambda a=args: moe_triton.fused_moe(*a), device, 2, reps), 4)
            res["torch_reference_ms"] = round(bench_ms(lambda a=args: reference.fused_moe(*a), device, 2, reps), 4)
            log(f"    {res['triton_ms']} ms (torch reference {res['torch_reference_ms']} ms)")
            results.append(res)
    return results


def gpu_correctness(device: torch.device, dry: bool) -> list[dict]:
    """Every Triton kernel against its torch reference at serving sizes (tiny sizes in a dry run)."""
    return (_attention_checks(device, dry) + _bidirectional_checks(device, dry) + _row_checks(device, dry)
            + _quant_linear_checks(device, dry)
            + _bitmask_checks(device, dry) + _lora_checks(device, dry) + _moe_checks(device, dry))


def gpu_decode_bandwidth(device: torch.device, dry: bool, peak_gbps: float) -> list[dict]:
    """Decode attention achieved bandwidth (K/V bytes read / time); Llama-3-8B heads (32 q, 8 KV, D 128)."""
    from pagedserve.kernels.attention import reference
    from pagedserve.kernels.attention import triton as attention_triton

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
    from pagedserve.kernels.attention import triton as attention_triton

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
        from pagedserve.backend.model.default_model import default_model_dir, is_prepared

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

    dry = kernel_timing.DRY_RUN = args.dry_run
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
    if "kv8" in parts:  # the 8-bit KV cache: its own part, so its compiles cannot push the others past their limit
        _section(report, "kv8_correctness", lambda: kv8_checks(device, dry, _check))
        _section(report, "kv8_decode", lambda: kv8_decode_time(device, dry, args.peak_gbps))
    checks = report.get("correctness")
    report["all_correct"] = all(c["ok"] for c in checks) if isinstance(checks, list) else None
    kv8 = report.get("kv8_correctness")
    report["kv8_all_correct"] = all(c["ok"] for c in kv8) if isinstance(kv8, list) else None
    decode = report.get("decode")
    if isinstance(decode, list) and decode:
        report["decode_target_70pct_met"] = all(r["heuristic_pct_of_peak"] >= 70 for r in decode[:2])
    prefill = report.get("prefill")
    if isinstance(prefill, list) and prefill:
        report["prefill_target_0.8x_sdpa_met"] = all(r["ratio_vs_sdpa"] >= 0.8 for r in prefill)
    return report
