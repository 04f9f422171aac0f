"""One real tritonserver for the whole session, on free loopback ports, serving the pagedserve model
repository (llm, preprocessing, postprocessing, ensemble) with a tiny random-weight Llama.

Use the `triton_server` fixture: it yields a `RunningTriton` (tests.support.servers).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.client.launcher import free_loopback_ports as free_ports
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

# Small, fixed engine settings: the prompt-length test relies on max_model_len.
TEST_ENGINE_PARAMS = {
    **CPU_FP32,
    "max_model_len": "256",
    "num_blocks": "256",
    "max_num_seqs": "64",
    "max_num_batched_tokens": "1024",
}


@pytest.fixture
def free_loopback_ports() -> list[int]:
    """Four distinct free ports on 127.0.0.1 (HTTP, gRPC, metrics, OpenAI)."""
    return free_ports(4)


@pytest.fixture(scope="session")
def triton_server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver with the whole pagedserve repository and the tiny Llama; stopped at session end."""
    work_dir = tmp_path_factory.mktemp("tritonserver")
    with triton_running(tiny_llama_path, work_dir, TEST_ENGINE_PARAMS) as running:
        yield running
