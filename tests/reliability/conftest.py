"""A tritonserver for the reliability tests: the tiny Llama with a small KV pool (block_size 4, 48 blocks) so
64 concurrent streams force preemption, served by the test llm model whose engine fails a step or compiles a
grammar slowly on FAULT_MARKER (tests/support/faults.py); and the OpenAI shim in front of it.
A test module that needs other settings names them LLM_PARAMS and asks for `llm_server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.faults import FAULT_MARKER, install_fault_model
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

SMALL_POOL_PARAMS = {
    **CPU_FP32,
    "block_size": "4",
    "num_blocks": "48",
    "max_model_len": "128",
    "max_num_seqs": "64",
    "max_num_batched_tokens": "512",
    "max_num_waiting": "256",
}


@pytest.fixture(scope="session")
def small_pool_server(tiny_llama_path: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver with a 48-block KV pool, its llm model the fault model (faults on FAULT_MARKER)."""
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp("reliability-triton"), SMALL_POOL_PARAMS,
                        adapt_repository=install_fault_model) as running:
        yield running


@pytest.fixture(scope="module")
def llm_server(request: pytest.FixtureRequest, tiny_llama_path: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """The test module's own tritonserver: the llm model alone, on the tiny Llama, with the module's
    LLM_PARAMS."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp(name), request.module.LLM_PARAMS,
                        llm_only=True) as running:
        yield running


@pytest.fixture(scope="session")
def shim_url(small_pool_server: RunningTriton) -> Iterator[str]:
    """The OpenAI shim (a subprocess, loopback) in front of small_pool_server."""
    with small_pool_server.openai_shim("--model-name", "tiny") as url:
        yield url


@pytest.fixture(scope="session")
def fault_marker() -> str:
    """Text that makes small_pool_server's engine step fail once for the request carrying it, and a grammar
    whose spec carries it compile SLOW_COMPILE_SECONDS late."""
    return FAULT_MARKER
