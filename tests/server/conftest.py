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


@pytest.fixture(scope="session")
def think_triton(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver (llm only) serving a copy of the tiny Llama whose chat template carries `<think>` and tools
    (pagedserve.testing.THINK_CHAT_TEMPLATE), for the reasoning, Responses and Messages tests."""
    from pagedserve.testing import copy_with_think_template

    work_dir = tmp_path_factory.mktemp("think-triton")
    model = copy_with_think_template(tiny_llama_path, work_dir / "tiny-think")
    params = {**TEST_ENGINE_PARAMS, "max_model_len": "1024", "max_num_seqs": "16"}
    with triton_running(model, work_dir, params, llm_only=True) as running:
        yield running


@pytest.fixture(scope="session")
def think_shim_url(think_triton: RunningTriton) -> Iterator[str]:
    """The shim in front of think_triton with `--reasoning-parser qwen3` and hermes tool calls."""
    with think_triton.openai_shim("--model-name", "tiny-think", "--reasoning-parser", "qwen3",
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield url
