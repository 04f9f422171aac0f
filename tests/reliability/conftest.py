"""A tritonserver for the reliability tests: the tiny Llama with a small KV pool (block_size 4, 48 blocks) so
64 concurrent streams force preemption, and the engine fault hook armed. Also the OpenAI shim in front of
it, and helpers to start more servers and wait for the engine to go idle.

The request helpers (grpc_inputs, RunningTriton, free_ports) are the ones of tests/server/conftest.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonServer,
    openai_shim_running,
    prepare_model_repository,
)

_spec = importlib.util.spec_from_file_location(
    "_pagedserve_server_test_helpers", Path(__file__).parent.parent / "server" / "conftest.py"
)
server_helpers = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_helpers)
RunningTriton = server_helpers.RunningTriton
free_ports = server_helpers.free_ports
grpc_inputs = server_helpers.grpc_inputs

FAULT_MARKER = "@@inject-step-fault@@"
FAULT_MARKER_ENV = "PAGEDSERVE_TEST_FAULT_MARKER"
SMALL_POOL_PARAMS = {
    "device": "cpu",
    "dtype": "float32",
    "block_size": "4",
    "num_blocks": "48",
    "max_model_len": "128",
    "max_num_seqs": "64",
    "max_num_batched_tokens": "512",
    "max_num_waiting": "256",
}
READY_TIMEOUT_SECONDS = 300
IDLE_TIMEOUT_SECONDS = 120
SHIM_STARTUP_TIMEOUT_SECONDS = 60


@contextlib.contextmanager
def triton_running(model_path: Path, work_dir: Path, params: dict[str, str], env: dict[str, str] | None = None,
                   llm_only: bool = False) -> Iterator[tuple[TritonServer, RunningTriton]]:
    """Start tritonserver with the pagedserve repository and `params` for the llm model, wait until ready,
    and stop it on leaving the block.

    `llm_only` leaves the ensemble and its tokenizer models out (two Python stubs fewer to start).
    """
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, work_dir / "models", str(model_path), params)
    if llm_only:
        for name in ("ensemble", "preprocessing", "postprocessing"):
            shutil.rmtree(repository / name)
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = work_dir / "tritonserver.log"
    server = TritonServer(repository, work_dir=work_dir, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=log_path)
    saved = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update(env or {})
    try:
        server.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        server.wait_ready(READY_TIMEOUT_SECONDS)
        yield server, RunningTriton(http_url=server.http_url, grpc_url=server.grpc_url,
                                    metrics_url=server.metrics_url, model_path=Path(model_path), log_path=log_path,
                                    engine_params=dict(params))
    finally:
        server.stop()


def until_idle(server: RunningTriton, timeout: float = IDLE_TIMEOUT_SECONDS) -> None:
    """Until the engine holds no request and no KV block; fails if that never happens (a leak)."""
    deadline = time.monotonic() + timeout
    while True:
        running = server.metric("vllm:num_requests_running")
        waiting = server.metric("vllm:num_requests_waiting")
        usage = server.metric("vllm:kv_cache_usage_perc")
        if running == waiting == usage == 0:
            return
        assert time.monotonic() < deadline, f"engine never idle: running={running} waiting={waiting} kv={usage}"
        time.sleep(0.1)


@pytest.fixture(scope="session")
def small_pool_server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver with a 48-block KV pool and the fault hook armed for FAULT_MARKER."""
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp("reliability-triton"), SMALL_POOL_PARAMS,
                        env={FAULT_MARKER_ENV: FAULT_MARKER}) as (_, running):
        yield running


@pytest.fixture(scope="session")
def shim_url(small_pool_server: RunningTriton) -> Iterator[str]:
    """The OpenAI shim (a subprocess, loopback) in front of small_pool_server."""
    with openai_shim_running(small_pool_server.grpc_url, small_pool_server.metrics_url, "--model-name", "tiny",
                             timeout=SHIM_STARTUP_TIMEOUT_SECONDS) as url:
        yield url


@pytest.fixture(scope="session")
def wait_idle():
    """until_idle(server, timeout=...): block until the engine holds no request and no KV block."""
    return until_idle


@pytest.fixture(scope="session")
def fault_marker() -> str:
    """Text that makes small_pool_server's engine step fail once for the request carrying it."""
    return FAULT_MARKER


@pytest.fixture(scope="session")
def make_inputs():
    """grpc_inputs(values) of tests/server/conftest.py: tritonclient inputs from plain values."""
    return grpc_inputs


@pytest.fixture(scope="session")
def triton_starter():
    """triton_running(model_path, work_dir, params, env=None, llm_only=False): a context manager of
    (TritonServer, RunningTriton)."""
    return triton_running
