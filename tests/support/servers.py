"""One way to start tritonserver (and the OpenAI shim in front of it) for a test, and `RunningTriton`, what
the tests ask a started server: HTTP generate, gRPC streams and its metrics."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonServer,
    fetch_metrics,
    free_loopback_ports,
    instance_metrics,
    model_metric,
    openai_shim_running,
    prepare_model_repository,
)
from tests.support.inputs import http_body
from tests.support.streams import GrpcStream, StreamResult

READY_TIMEOUT_SECONDS = 300
REQUEST_TIMEOUT_SECONDS = 120
IDLE_TIMEOUT_SECONDS = 120
SHIM_STARTUP_TIMEOUT_SECONDS = 60
CPU_FP32 = {"device": "cpu", "dtype": "float32"}


@dataclass
class RunningTriton:
    """A started tritonserver: its `host:port` URLs as tritonclient takes them, and what the tests ask it.
    `server` is its process when the test started it (not when `pagedserve serve` did)."""

    http_url: str
    grpc_url: str
    metrics_url: str
    model_path: Path
    log_path: Path | None = None
    engine_params: dict[str, str] = field(default_factory=dict)
    server: TritonServer | None = None

    def metrics_text(self) -> str:
        """The Prometheus text of the metrics port."""
        return fetch_metrics(self.metrics_url)

    def metric(self, name: str, model: str = "llm") -> float:
        """The sample `name` (e.g. "vllm:kv_cache_usage_perc") of `model`, summed over its instances; 0.0 if
        absent."""
        return model_metric(self.metrics_text(), name, model)

    def instance_metrics(self, name: str, model: str = "llm") -> dict[str, float]:
        """The sample `name` of each instance of `model`: {instance name: value}."""
        return instance_metrics(self.metrics_text(), name, model)

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_SECONDS) -> None:
        """Until the engine holds no request and no KV block; fails if that never happens (a leak)."""
        deadline = time.monotonic() + timeout
        while True:
            running = self.metric("vllm:num_requests_running")
            waiting = self.metric("vllm:num_requests_waiting")
            usage = self.metric("vllm:kv_cache_usage_perc")
            if running == waiting == usage == 0:
                return
            assert time.monotonic() < deadline, (
                f"engine never idle: running={running} waiting={waiting} kv={usage}")
            time.sleep(0.1)

    def post(self, path: str, body: dict | bytes) -> tuple[int, str]:
        """POST `http_body(body)` to the HTTP endpoint; (status, body text), errors included."""
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=http_body(body),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def generate(self, model: str, body: dict) -> dict:
        """`v2/models/<model>/generate`; the JSON answer (an {"error": ...} object on failure)."""
        return json.loads(self.post(f"/v2/models/{model}/generate", body)[1])

    def generate_stream(self, model: str, body: dict) -> list[dict]:
        """`v2/models/<model>/generate_stream`: the JSON object of every SSE `data:` event."""
        _, text = self.post(f"/v2/models/{model}/generate_stream", body)
        return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]

    def open_stream(self, model: str, values: dict[str, object], request_id: str = "") -> GrpcStream:
        """Send one request on a new gRPC stream and return the stream (close it)."""
        stream = GrpcStream(self.grpc_url)
        stream.send(model, values, request_id)
        return stream

    def grpc_stream(self, model: str, values: dict[str, object], request_id: str = "") -> StreamResult:
        """One request over a gRPC bidirectional stream, collected until its final response or error."""
        with self.open_stream(model, values, request_id) as stream:
            return stream.collect()

    @contextlib.contextmanager
    def openai_shim(self, *shim_args: str) -> Iterator[str]:
        """The OpenAI shim (a subprocess on a free loopback port) in front of this server; yields its URL."""
        with openai_shim_running(self.grpc_url, self.metrics_url, *shim_args,
                                 timeout=SHIM_STARTUP_TIMEOUT_SECONDS) as url:
            yield url


@contextlib.contextmanager
def triton_running(model_path: Path, work_dir: Path, params: dict[str, str], *,
                   env: dict[str, str] | None = None, llm_only: bool = False,
                   instances: int | None = None,
                   adapt_repository: Callable[[Path], None] | None = None) -> Iterator[RunningTriton]:
    """Start tritonserver with the pagedserve repository and `params` for the llm model on free loopback
    ports, wait until it is ready, and stop it on leaving the block. `env` is set for the server only.

    `llm_only` leaves the ensemble and its tokenizer models out (two Python stubs fewer to start);
    `instances` sets the llm model's instance_group count (its kind kept, KIND_CPU); `adapt_repository` may
    change the prepared repository before the server starts (a test's own llm model).
    """
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, work_dir / "models", str(model_path),
                                          params, None if instances is None else (instances, None))
    if llm_only:
        for name in ("ensemble", "preprocessing", "postprocessing"):
            shutil.rmtree(repository / name)
    if adapt_repository is not None:
        adapt_repository(repository)
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    log_path = work_dir / "tritonserver.log"
    server = TritonServer(repository, work_dir=work_dir, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=log_path)
    with mock.patch.dict(os.environ, env or {}):
        server.start()
    try:
        server.wait_ready(READY_TIMEOUT_SECONDS)
        yield RunningTriton(http_url=server.http_url, grpc_url=server.grpc_url,
                            metrics_url=server.metrics_url, model_path=Path(model_path), log_path=log_path,
                            engine_params=dict(params), server=server)
    finally:
        server.stop()
