"""Bounded soak of a real tritonserver running pagedserve: mixed-length streams, cancellations and bad requests
for --minutes, then a leak check. Not part of CI.

Reports requests served, errors by kind, p99 latency per window, peak server memory, and whether KV blocks,
threads or file descriptors leaked (compared with a warmed-up baseline once the server is idle again).

    python bench/soak.py --minutes 2 --out bench/results/soak_2min.json
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonServer,
    fetch_metrics,
    free_loopback_ports,
    model_metric,
    prepare_model_repository,
    process_group_members,
)

ENGINE_PARAMS = {"device": "cpu", "dtype": "float32", "block_size": "4", "num_blocks": "96", "max_model_len": "160",
                 "max_num_seqs": "32", "max_num_batched_tokens": "512", "max_num_waiting": "64"}
WORDS = "the quick brown fox jumps over a lazy dog while paged blocks of cache move in and out".split()
BAD_SAMPLING = [{"top_p": 0}, {"temperature": -1}, {"max_tokens": 0}, {"n": 99}, {"logprobs": 21},
                {"stop": ["x"] * 17}, {"best_off": 1}, {"max_tokens": 10_000}]
ANSWER_TIMEOUT_SECONDS = 300
WINDOW_SECONDS = 30.0


def _inputs(values: dict) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in values.items():
        if isinstance(value, bool):
            array, dtype = np.array([value]), "BOOL"
        else:
            text = json.dumps(value) if isinstance(value, dict) else value
            array, dtype = np.array([text.encode()], dtype=np.object_), "BYTES"
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class Worker:
    """One client thread with its own gRPC stream, sending one request at a time."""

    def __init__(self, url: str, seed: int, stats: Stats):
        self.url, self.rng, self.stats = url, random.Random(seed), stats

    def run(self, deadline: float) -> None:
        """Send a random mix until `deadline`; a dropped stream is replaced."""
        while time.monotonic() < deadline:
            results: queue.Queue = queue.Queue()
            client = grpcclient.InferenceServerClient(self.url)
            client.start_stream(callback=lambda result, error, answers=results: answers.put((result, error)))
            try:
                while time.monotonic() < deadline:
                    if not self._one(client, results):
                        break
            finally:
                client.stop_stream(cancel_requests=True)
                client.close()

    def _one(self, client, results: queue.Queue) -> bool:
        """One request; False when the stream must be replaced (after a cancellation)."""
        roll = self.rng.random()
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, 25)))
        sampling = {"max_tokens": self.rng.randint(1, 64), "temperature": self.rng.choice([0.0, 0.8]),
                    "seed": self.rng.randint(0, 1000)}
        kind = "normal"
        if roll < 0.1:
            kind, sampling = "bad", dict(self.rng.choice(BAD_SAMPLING))
        elif roll < 0.25:
            kind, sampling["max_tokens"], sampling["ignore_eos"] = "cancel", 64, True
        start = time.monotonic()
        client.async_stream_infer("llm", _inputs({"text_input": prompt, "stream": True,
                                                   "sampling_parameters": sampling}),
                                  enable_empty_final_response=True)
        stop_after = self.rng.randint(1, 8) if kind == "cancel" else None
        tokens = 0
        while True:
            result, error = results.get(timeout=ANSWER_TIMEOUT_SECONDS)
            if error is not None:
                self.stats.record(kind, "refused" if kind == "bad" else _error_kind(str(error)), None)
                return True
            tokens += 1
            if stop_after is not None and tokens >= stop_after:
                self.stats.record(kind, "cancelled", None)
                return False
            if result.get_response().parameters["triton_final_response"].bool_param:
                outcome = "ok" if kind == "normal" else f"unexpected_success_{kind}"
                self.stats.record(kind, outcome, time.monotonic() - start)
                return True


def _error_kind(message: str) -> str:
    if "busy" in message:
        return "server_busy"
    return "error: " + re.sub(r"\d+", "N", message)[:80]


class Stats:
    """Outcomes and latencies, thread-safe."""

    def __init__(self, start: float):
        self.start, self.lock = start, threading.Lock()
        self.outcomes: Counter = Counter()
        self.latencies: list[tuple[float, float]] = []

    def record(self, kind: str, outcome: str, latency: float | None) -> None:
        """Count one finished request."""
        with self.lock:
            self.outcomes[f"{kind}/{outcome}"] += 1
            if latency is not None:
                self.latencies.append((time.monotonic() - self.start, latency))

    def p99_by_window(self) -> list[dict]:
        """p99 end-to-end latency of completed normal requests per WINDOW_SECONDS window."""
        windows: dict[int, list[float]] = {}
        for at, latency in self.latencies:
            windows.setdefault(int(at // WINDOW_SECONDS), []).append(latency)
        return [{"window_start_s": w * WINDOW_SECONDS, "requests": len(v), "p99_s": round(float(np.percentile(v, 99)), 4)}
                for w, v in sorted(windows.items())]


def _resources(pgid: int) -> dict[str, int]:
    """RSS (bytes), threads and open file descriptors summed over tritonserver's process group."""
    rss = threads = fds = 0
    for pid in process_group_members(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss += int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
            threads += int(re.search(r"Threads:\s+(\d+)", status).group(1))
            fds += len(list(Path(f"/proc/{pid}/fd").iterdir()))
        except (OSError, AttributeError):
            continue
    return {"rss_bytes": rss, "threads": threads, "fds": fds}


def _metric(metrics_url: str, name: str) -> float:
    return model_metric(fetch_metrics(metrics_url), name)


def _wait_idle(metrics_url: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_metric(metrics_url, m) == 0 for m in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                      "vllm:kv_cache_usage_perc")):
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    """Start a server, warm up, soak, check for leaks, write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/soak.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pagedserve-soak-"))
    model = args.model
    if model is None:
        from pagedserve.testing import make_tiny_model

        model = str(make_tiny_model(work / "tiny-llama", "llama"))
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, work / "models", model, ENGINE_PARAMS)
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    with TritonServer(repository, work_dir=work, http_port=http_port, grpc_port=grpc_port,
                      metrics_port=metrics_port, log_file=work / "tritonserver.log") as server:
        server.wait_ready(900)
        pgid = server.process.pid
        warm = Stats(time.monotonic())
        Worker(server.grpc_url, -1, warm).run(time.monotonic() + 5)  # load lazy paths before the baseline
        _wait_idle(server.metrics_url)
        baseline = _resources(pgid)
        start = time.monotonic()
        stats = Stats(start)
        deadline = start + args.minutes * 60
        threads = [threading.Thread(target=Worker(server.grpc_url, args.seed + i, stats).run, args=(deadline,))
                   for i in range(args.concurrency)]
        for thread in threads:
            thread.start()
        peak_rss = baseline["rss_bytes"]
        while any(t.is_alive() for t in threads):
            peak_rss = max(peak_rss, _resources(pgid)["rss_bytes"])
            time.sleep(1.0)
        elapsed = time.monotonic() - start
        idle = _wait_idle(server.metrics_url)
        time.sleep(1.0)  # let cancelled streams' server-side state go
        after = _resources(pgid)
        report = {
            "minutes": args.minutes, "concurrency": args.concurrency, "engine_params": ENGINE_PARAMS,
            "elapsed_s": round(elapsed, 1),
            "requests": sum(stats.outcomes.values()),
            "served_ok": stats.outcomes.get("normal/ok", 0),
            "outcomes": dict(sorted(stats.outcomes.items())),
            "p99_latency_by_window": stats.p99_by_window(),
            "peak_rss_bytes": peak_rss,
            "baseline": baseline, "after": after,
            "leaks": {
                "kv_blocks_in_use_after": _metric(server.metrics_url, "vllm:kv_cache_usage_perc"),
                "engine_idle_after": idle,
                "threads_delta": after["threads"] - baseline["threads"],
                "fds_delta": after["fds"] - baseline["fds"],
            },
            "preemptions": _metric(server.metrics_url, "vllm:num_preemptions_total"),
            "step_failures": _metric(server.metrics_url, "pagedserve:engine_step_failures_total"),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
