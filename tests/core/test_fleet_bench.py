"""bench/fleet.py's workload and accounting: every policy's tenants have the same prompt lengths and other words, the
KV cache holds about half their prefixes (so round robin cannot keep them all), the arrivals are Poisson, and the
prefix-cache counters are read from both vLLM's and our exposition."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("fleet_bench", BENCH / "fleet.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_each_policy_gets_tenants_of_the_same_lengths_with_other_words(bench):
    lengths = bench.tenant_lengths(8, 0)
    assert len(lengths) == 8 and all(1000 <= n <= 2000 for n in lengths)
    first, second = bench.tenant_prompts(lengths, 0), bench.tenant_prompts(lengths, 100)
    assert [len(p.split()) for p in first] == [len(p.split()) for p in second]
    assert all(a[:64] != b[:64] for a, b in zip(first, second, strict=True))  # no shared first block


def test_arrivals_are_poisson_at_the_rate_and_draw_every_tenant(bench):
    prompts = bench.tenant_prompts(bench.tenant_lengths(4, 1), 1)
    arrivals = bench.workload(prompts, 2000, 2.0, 3)
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.15)  # exponential: sd = mean
    assert {prompt.split("\n")[0] for _, prompt in arrivals} == set(prompts)


def test_the_cache_holds_about_half_the_prefixes(bench, monkeypatch):
    monkeypatch.setattr(bench, "prefix_blocks", lambda model, prompts, block_size: sum(
        len(p.split()) // block_size for p in prompts))
    args = argparse.Namespace(model="m", tenants=8, seed=0, block_size=32, cache_fraction=0.6, headroom_blocks=8,
                              max_model_len=3072)
    blocks, total = bench.cache_size(args)
    assert blocks == -(-total * 6 // 10) + 8
    assert total / 2 < blocks < total  # one replica cannot hold every tenant, half of them fit


def test_counters_read_vllm_and_our_metrics(bench, monkeypatch):
    vllm = ('vllm:prompt_tokens_total{engine="0",model_name="m"} 4548.0\n'
            'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09\n'
            'vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 3008.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3008.0\n')
    ours = 'vllm:prompt_tokens{engine="1",model_name="m"} 100\nvllm:prefix_cache_hits{engine="1",model_name="m"} 64\n'
    monkeypatch.setattr(bench, "fetch_metrics", {"a": vllm, "b": ours}.get)
    assert bench.counters(["a", "b"]) == [(4548.0, 3008.0), (100.0, 64.0)]
