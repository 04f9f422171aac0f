"""The GPU check's 8-bit KV cache part (issue 34): the fp8 write bytes, fp8 attention against the torch reference on
the dequantized cache, and decode time on an fp8 cache beside a bf16 one. bench/kernels_gpu.py runs it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kernel_timing import bench_ms, log, paged_batch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
K_SCALE, V_SCALE = 0.37, 0.011  # not powers of two: the division's rounding shows in the bytes


def _fp8_batch(lens, dtype, device, seed, hq=32, hkv=8, d=128, bs=16):
    """(bf16 paged_batch arguments, the same with its caches quantized to dtype)."""
    from pagedserve.kernels import kv8

    pa, _ = paged_batch(lens, hq, hkv, d, bs, torch.bfloat16, device, seed=seed)
    key, value = kv8.quantize(pa[1] * 2.0, dtype, K_SCALE), kv8.quantize(pa[2] * 0.1, dtype, V_SCALE)
    return pa, (pa[0], key, value, *pa[3:])


def _dequantized(fp8: tuple) -> tuple:
    """The reference's arguments: the fp8 batch's query and caches in fp32 (stored * scale)."""
    from pagedserve.kernels import kv8

    return (fp8[0].float(), kv8.dequantize(fp8[1], K_SCALE), kv8.dequantize(fp8[2], V_SCALE), *fp8[3:])


def _fused_rotary_check(key, value, slots, dtype, dry, check) -> dict:
    """The fused rotary + fp8 write on the GPU against torch's rotary and the reference write on the CPU: the GPU
    rounds to bf16 as torch does, so the bytes must be equal. The interpreter truncates to bf16: a dry run compares
    with the unfused Triton rotary instead."""
    from pagedserve.kernels.cache import reference as cache_reference
    from pagedserve.kernels.rope import compute_cos_sin_cache
    from pagedserve.kernels.rope import reference as rope_reference
    from pagedserve.kernels.rope import triton as rope_triton

    tokens, hkv, d = key.shape
    device = key.device
    cos_sin = compute_cos_sin_cache(d, 8192, 500000.0, None, torch.bfloat16, device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    query = torch.randn(tokens, 4 * hkv, d, device=device, dtype=torch.bfloat16)
    nb = slots.max().item() // 16 + 1
    got = [torch.zeros(nb, 16, hkv, d, device=device, dtype=dtype) for _ in range(2)]
    rope_triton.rotary_embedding_and_cache(positions, query, key, value, cos_sin, *got, slots, k_scale=K_SCALE,
                                           v_scale=V_SCALE)
    want = [torch.zeros(nb, 16, hkv, d, dtype=dtype) for _ in range(2)]
    rotary = rope_triton.rotary_embedding if dry else rope_reference.rotary_embedding
    _, rotated = rotary(positions.cpu(), query.cpu(), key.cpu(), cos_sin.cpu())
    cache_reference.reshape_and_cache(rotated, value.cpu(), *want, slots.cpu(), k_scale=K_SCALE, v_scale=V_SCALE)
    return check(f"rotary_embedding_and_cache {dtype} bytes", torch.stack(got).view(torch.uint8).cpu(),
                 torch.stack(want).view(torch.uint8), 0, 0)


def kv8_checks(device: torch.device, dry: bool, check: Callable[..., dict]) -> list[dict]:
    """reshape_and_cache into both fp8 formats byte for byte (the oracle computed on the CPU: CUDA's torch divides by
    a scalar through its reciprocal); paged attention, decode with and without splits, windowed and capped."""
    from pagedserve.kernels.attention import reference
    from pagedserve.kernels.attention import triton as attention_triton
    from pagedserve.kernels.cache import reference as cache_reference
    from pagedserve.kernels.cache import triton as cache_triton

    results = []
    tokens, hkv, d = (4096, 8, 128) if not dry else (17, 2, 64)
    for dtype in FP8:
        key, value = (torch.randn(tokens, hkv, d, device=device, dtype=torch.bfloat16) * s for s in (30.0, 0.5))
        nb = tokens // 16 + 64
        slots = torch.randperm(nb * 16, device=device)[:tokens]
        slots[::97] = -1
        got = [torch.zeros(nb, 16, hkv, d, device=device, dtype=dtype) for _ in range(2)]
        want = [torch.zeros(nb, 16, hkv, d, dtype=dtype) for _ in range(2)]
        cache_triton.reshape_and_cache(key, value, *got, slots, k_scale=K_SCALE, v_scale=V_SCALE)
        cache_reference.reshape_and_cache(key.cpu(), value.cpu(), *want, slots.cpu(), k_scale=K_SCALE,
                                          v_scale=V_SCALE)
        results.append(check(f"reshape_and_cache {dtype} bytes", torch.stack(got).view(torch.uint8).cpu(),
                             torch.stack(want).view(torch.uint8), 0, 0))
        results.append(_fused_rotary_check(key, value, slots, dtype, dry, check))

        lens = [(512, 2048), (1, 4000), (37, 37), (1, 1), (300, 1500)] if not dry else [(9, 30), (1, 20), (1, 1)]
        _, fp8 = _fp8_batch(lens, dtype, device, seed=3)
        ref = _dequantized(fp8)
        scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
        results.append(check(f"paged_attention {dtype} mixed", attention_triton.paged_attention(*fp8, **scales),
                             reference.paged_attention(*ref), 2e-2, 2e-2))
        # e5m2 differs from e4m3 only in its loads' conversion: the windowed variant and the heuristic split once.
        if dtype == torch.float8_e4m3fn:
            mods = dict(sliding_window=700 if not dry else 7, logits_soft_cap=30.0)
            results.append(check(f"paged_attention {dtype} mixed windowed capped",
                                 attention_triton.paged_attention(*fp8, **scales, **mods),
                                 reference.paged_attention(*ref, **mods), 2e-2, 2e-2))
        decode = [(1, 700 + 13 * i) for i in range(24)] + [(1, 4000)] if not dry else [(1, 20), (1, 1)]
        _, fp8 = _fp8_batch(decode, dtype, device, seed=4)
        want = reference.paged_attention(*_dequantized(fp8))
        for splits in (None, 8) if dtype == torch.float8_e4m3fn else (8,):
            results.append(check(f"paged_attention {dtype} decode splits={splits}",
                                 attention_triton.paged_attention(*fp8, **scales, num_splits=splits), want, 2e-2,
                                 2e-2))
    return results


def kv8_decode_time(device: torch.device, dry: bool, peak_gbps: float) -> list[dict]:
    """Decode attention on an e4m3 cache against the same batch on a bf16 cache (Llama-3-8B heads)."""
    from pagedserve.kernels.attention import triton as attention_triton

    cases = [(64, 4096), (8, 32768), (1, 32768)] if not dry else [(4, 64)]
    rows = []
    for batch, context in cases:
        lens = [(1, context)] * batch
        bf16, fp8 = _fp8_batch(lens, torch.float8_e4m3fn, device, seed=batch)
        reps = 5 if dry else 20
        fp8_ms = bench_ms(lambda a=fp8: attention_triton.paged_attention(*a, k_scale=K_SCALE, v_scale=V_SCALE),
                          device, 3, reps)
        bf16_ms = bench_ms(lambda a=bf16: attention_triton.paged_attention(*a), device, 3, reps)
        kv_bytes = context * batch * 8 * 128 * 2  # K and V, one byte each
        row = {"batch": batch, "context": context, "fp8_ms": round(fp8_ms, 4), "bf16_ms": round(bf16_ms, 4),
               "speedup": round(bf16_ms / fp8_ms, 3), "fp8_GBps": round(kv_bytes / fp8_ms / 1e6, 1)}
        row["fp8_pct_of_peak"] = round(100 * row["fp8_GBps"] / peak_gbps, 1)
        rows.append(row)
        log(f"  fp8 decode B={batch} ctx={context}: {fp8_ms:.3f} ms vs bf16 {bf16_ms:.3f} ms ({row['speedup']}x), "
            f"{row['fp8_GBps']} GB/s of KV")
    return rows
