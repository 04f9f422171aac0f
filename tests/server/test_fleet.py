"""`pagedserve serve --data-parallel-size 2` behind vllm-router: prefix affinity proven by the engines' prefix-cache
hit counters (kv_events and cache_aware against round robin over the same two engines), the engine label on each
replica's metrics, a replica killed mid-run routed around, and bad fleet options refused at start."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pagedserve.client import fleet
from pagedserve.client.launcher import fetch_metrics, free_loopback_ports, wait_for_http_ok

START_SECONDS = 600
TENANT_WORDS = "you are the assistant of tenant {} and you answer briefly and politely"


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _hits(metrics_urls: list[str]) -> list[float]:
    """Each engine's prefix-cache hit tokens, checking its engine label on the way."""
    found = []
    for rank, url in enumerate(metrics_urls):
        match = re.search(r'^vllm:prefix_cache_hits\{engine="(\d+)"[^}]*\} (\S+)$', fetch_metrics(url), re.MULTILINE)
        assert match and int(match[1]) == rank, url
        found.append(float(match[2]))
    return found


def _tenants(router_url: str, metrics_urls: list[str], names: str) -> float:
    """Three requests for each tenant (a long shared system prompt, a different question), one at a time;
    returns the prefix-cache hit tokens the engines gained."""
    before = sum(_hits(metrics_urls))
    for name in names:
        system = " ".join([TENANT_WORDS.format(name)] * 12)
        for question in range(3):
            status, body = _post(f"{router_url}/v1/completions", {
                "model": "fleet", "prompt": f"{system}. question {question}?", "max_tokens": 2})
            assert status == 200, body
    return sum(_hits(metrics_urls)) - before


def _extra_router(policy: str, workers: list[str]) -> tuple[subprocess.Popen, str]:
    port, prometheus = free_loopback_ports(2)
    proc = subprocess.Popen([fleet.router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                             "--prometheus-port", str(prometheus), "--worker-urls", *workers],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_http_ok(f"{url}/health", proc, 120)
    return proc, url


@pytest.mark.slow
def test_two_engines_behind_vllm_router_keep_each_prefix_on_one_engine_and_survive_a_replica(tmp_path,
                                                                                             tiny_llama_path):
    model = tmp_path / "fleet"
    shutil.copytree(tiny_llama_path, model)  # the model's name on /v1/models is its folder's
    (openai_port,) = free_loopback_ports(1)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.client.cli", "serve", "--model", str(model), "--data-parallel-size", "2",
         "--router", "kv_events", f"--openai-port={openai_port}", "--device", "cpu", "--dtype", "float32",
         "--block-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    routers = []
    try:
        deadline = time.monotonic() + START_SECONDS
        while not any("Ctrl-C stops it." in line for line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        engines = [re.search(r"OpenAI (\S+)/v1, metrics (\S+), tritonserver pid (\d+)", line)
                   for line in lines if line.startswith("  engine ")]
        workers, metrics_urls, pids = zip(*((m[1], m[2], int(m[3])) for m in engines), strict=True)
        router_url = f"http://127.0.0.1:{openai_port}"
        assert "engine 0: cores" in "".join(lines) and len(workers) == 2
        # Each tenant's repeats find its prefix cached: 2 repeats x 3 tenants, each hitting its whole prompt
        # but the last partial block (the prompts are ~150 tokens: at least 8 blocks of 16 each time).
        kv_events = _tenants(router_url, list(metrics_urls), "ABC")
        assert kv_events >= 6 * 8 * 16
        # The same engines behind vllm-router's cache_aware and round_robin policies, fresh tenants each.
        for policy in ("cache_aware", "round_robin"):
            routers.append(_extra_router(policy, list(workers)))
        cache_aware = _tenants(routers[0][1], list(metrics_urls), "DEF")
        round_robin = _tenants(routers[1][1], list(metrics_urls), "GHI")
        assert cache_aware >= 6 * 8 * 16
        assert round_robin < cache_aware, (round_robin, cache_aware)  # in turn, a tenant's repeats split
        # A replica dies: the router sends every request to the other one.
        os.kill(pids[1], signal.SIGKILL)
        for question in range(3):
            status, body = _post(f"{router_url}/v1/completions", {"model": "fleet", "prompt": f"after {question}",
                                                                  "max_tokens": 2})
            assert status == 200, body
        while not any("replica 1 exited" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
    finally:
        for proc, _ in routers:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
        reader.join(timeout=30)
    assert launcher.returncode == 0, "".join(lines)


def test_bad_fleet_options_are_refused_naming_the_flag(tmp_path):
    run = [sys.executable, "-m", "pagedserve.client.cli", "serve", "--model", str(tmp_path)]
    bad_router = subprocess.run([*run, "--data-parallel-size", "2", "--router", "nearest"], capture_output=True,
                                text=True, timeout=120)
    assert bad_router.returncode == 2 and "--router" in bad_router.stderr
    bad_size = subprocess.run([*run, "--data-parallel-size", "0"], capture_output=True, text=True, timeout=120)
    assert bad_size.returncode != 0 and "--data-parallel-size" in bad_size.stderr
    no_openai = subprocess.run([*run, "--data-parallel-size", "2", "--no-openai"], capture_output=True, text=True,
                               timeout=120)
    assert no_openai.returncode != 0 and "--no-openai" in no_openai.stderr


def test_cores_split_into_contiguous_groups_and_ports_follow_vllms_rank_offset():
    assert fleet.core_groups(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert fleet.core_groups(3, [0, 1]) == [[0], [1], [0]]
    params, endpoint, replay = fleet.kv_events_params({"block_size": "16"}, 2)
    config = json.loads(params["kv_events_config"])
    assert config["enable_kv_cache_events"] and endpoint.startswith("tcp://*:") and replay.startswith("tcp://*:")

    class Args:
        host, openai_port, router = "127.0.0.1", 9000, "kv_events"

    plans = [fleet.ReplicaPlan(r, [r], 1, 2, 3, 8000 + r, {}) for r in range(2)]
    command = fleet.router_command(Args, plans, Path("/tok"), ("tcp://*:7000", "tcp://*:7100"), 16, 9100)
    assert command[command.index("--policy") + 1] == "kv_aware"
    sources = [command[i + 1] for i, arg in enumerate(command) if arg == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:8000=tcp://127.0.0.1:7000", "http://127.0.0.1:8001=tcp://127.0.0.1:7001"]
