"""`pagedserve serve --kv-cache-dtype fp8` serves, and the operator sees what the budget bought: the block count
and KV dtype in serve's own output at start, and vllm:cache_config_info's cache_dtype label."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

DEADLINE_SECONDS = 300
BUDGET = 1 << 20


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _read(url: str, body: dict | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30) as reply:
        return reply.read().decode()


@pytest.mark.slow
def test_serve_with_an_fp8_kv_cache_prints_its_blocks_and_labels_its_dtype(tiny_llama_path):
    http_port, grpc_port, metrics_port, openai_port = _free_ports(4)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.client.cli", "serve", f"--model={tiny_llama_path}",
         "--kv-cache-dtype=fp8", f"--kv-cache-memory-bytes={BUDGET}", f"--http-port={http_port}",
         f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", f"--openai-port={openai_port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while not any("Ctrl-C stops it." in line for line in lines):
            assert launcher.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "serve did not come up:\n" + "".join(lines)
            time.sleep(1)
        answer = json.loads(_read(f"http://127.0.0.1:{http_port}/v2/models/llm/generate",
                                  {"text_input": "Hello", "max_tokens": 6, "temperature": 0}))
        assert answer["text_output"].startswith("Hello") and len(answer["text_output"]) > len("Hello")
        metrics = _read(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        reader.join(timeout=30)
    output = "".join(lines)
    # The tiny model's block: 2 layers x K and V x 16 tokens x 2 heads x 16 dims x 1 byte = 2 KiB.
    blocks = BUDGET // (2 * 2 * 16 * 2 * 16)
    assert f"KV cache: {blocks} blocks of 16 tokens (1.0 MiB), dtype fp8 (float8_e4m3fn)" in output, output
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1", metrics, re.MULTILINE)
    assert info, metrics
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
    assert labels["cache_dtype"] == "fp8" and labels["num_gpu_blocks"] == str(blocks)
