"""One real tritonserver for the whole session, on free loopback ports, serving the pagedserve model
repository (llm, preprocessing, postprocessing, ensemble) with a tiny random-weight Llama.

Use the `triton_server` fixture: it yields a `RunningTriton` (URLs, model path, metric reader).
"""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pagedserve.client.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, prepare_model_repository

# Small, fixed engine settings: the prompt-length test relies on max_model_len.
TEST_ENGINE_PARAMS = {
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": "256",
    "num_blocks": "256",
    "max_num_seqs": "64",
    "max_num_batched_tokens": "1024",
}
READY_TIMEOUT_SECONDS = 300


@dataclass
class RunningTriton:
    """A started tritonserver: `host:port` URLs as tritonclient takes them, and a metric reader."""

    http_url: str
    grpc_url: str
    metrics_url: str
    model_path: Path
    log_path: Path
    engine_params: dict[str, str]

    def metrics_text(self) -> str:
        """The Prometheus text of the metrics port."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            return reply.read().decode()

    def metric(self, name: str, model: str = "llm") -> float:
        """The value of the sample `name` (e.g. "vllm:kv_cache_usage_perc") for `model`; 0.0 if absent."""
        pattern = re.compile(r"^" + re.escape(name) + r"\{([^}]*)\}\s+(\S+)$", re.MULTILINE)
        for labels, value in pattern.findall(self.metrics_text()):
            if f'model="{model}"' in labels:
                return float(value)
        return 0.0


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture(scope="session")
def triton_server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver with the whole pagedserve repository and the tiny Llama; stopped at session end."""
    work_dir = tmp_path_factory.mktemp("tritonserver")
    repository = prepare_model_repository(
        DEFAULT_MODEL_REPOSITORY, work_dir / "models", str(tiny_llama_path), TEST_ENGINE_PARAMS
    )
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = work_dir / "tritonserver.log"
    server = TritonServer(
        repository,
        work_dir=work_dir,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        log_file=log_path,
    )
    server.start()
    try:
        server.wait_ready(READY_TIMEOUT_SECONDS)
        yield RunningTriton(
            http_url=server.http_url,
            grpc_url=server.grpc_url,
            metrics_url=server.metrics_url,
            model_path=Path(tiny_llama_path),
            log_path=log_path,
            engine_params=dict(TEST_ENGINE_PARAMS),
        )
    finally:
        server.stop()
