"""Tensor parallelism through tritonserver: the llm instance with tensor_parallel_size 2 starts its worker in
initialize and serves one rank's tokens; a killed worker ends requests with an error while the server stays
answerable and the llm model is unloaded (not ready); SIGTERM then stops the instance cleanly, its worker joined."""

from __future__ import annotations

import argparse
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.triton.settings import engine_arguments
from pagedserve.client import launcher
from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    prepare_model_repository,
    process_group_members,
)
from tests.support.engines import cpu_engine
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

PARAMS = {**CPU_FP32, "tensor_parallel_size": "2", "cpu_threads": "1", "num_blocks": "64", "max_model_len": "256"}
PROMPT = "the quick brown fox"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
EXIT_SECONDS = 60


@pytest.fixture(scope="module")
def tp_server(tiny_llama_path, tmp_path_factory) -> Iterator[RunningTriton]:
    """The llm model alone with two ranks; the module's last test stops it."""
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp("triton-tp"), PARAMS, llm_only=True) as running:
        yield running


def _ask(running: RunningTriton):
    return running.grpc_stream("llm", {"text_input": PROMPT, "sampling_parameters": GREEDY,
                                       "exclude_input_in_output": True})


def _tp_workers(server_pid: int) -> list[int]:
    """Live spawned multiprocessing children below the server (the stub's tensor-parallel ranks)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            pid, ancestors = int(proc.name), _ancestors(int(proc.name))
        except (OSError, ValueError):
            continue
        if b"multiprocessing.spawn" in cmdline and server_pid in ancestors:
            found.append(pid)
    return found


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


@pytest.mark.slow
def test_tp2_instance_serves_the_tokens_of_one_rank(tp_server):
    result = _ask(tp_server)
    assert result.error is None, result.error
    engine = cpu_engine(tp_server.model_path, num_blocks=64, max_model_len=256)
    (expected,) = engine.generate(PROMPT, SamplingParams(**GREEDY))
    assert "".join(result.texts()) == expected.outputs[0].text
    assert len(_tp_workers(tp_server.server.process.pid)) == 1


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.slow
def test_a_killed_worker_ends_requests_with_an_error_marks_the_model_not_ready_and_sigterm_still_stops_cleanly(
        tp_server):
    server = tp_server.server
    base = f"http://{tp_server.http_url}"
    assert _status(f"{base}/v2/models/llm/ready") == 200
    (worker,) = _tp_workers(server.process.pid)
    os.kill(worker, signal.SIGKILL)
    start = time.monotonic()
    result = _ask(tp_server)  # the step that finds it dead
    assert result.error is not None and "tensor-parallel worker rank 1" in str(result.error), result.error
    assert time.monotonic() - start < 30
    while _status(f"{base}/v2/models/llm/ready") == 200:  # the broken engine has its model unloaded
        assert time.monotonic() - start < 60, "the llm model still reads ready"
        time.sleep(0.2)
    result = _ask(tp_server)
    assert result.error is not None, "a request after the unload must fail"
    assert _status(f"{base}/v2/health/live") == 200
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=EXIT_SECONDS) == 0
    log = tp_server.log_path.read_text(errors="replace")
    assert "successfully unloaded 'llm' version 1" in log and "; unloading model 'llm'" in log, log[-3000:]
    pgid = server.process.pid
    server.stop()
    assert not process_group_members(pgid)


def test_serve_tensor_parallel_size_becomes_the_llm_models_parameter(tmp_path):
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert launcher.tensor_parallel_parameters(parser.parse_args([])) == {}
    params = launcher.tensor_parallel_parameters(parser.parse_args(["--tensor-parallel-size", "2"]))
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "repo", "/m", params)
    text = (repository / "llm" / "config.pbtxt").read_text()
    assert 'key: "tensor_parallel_size" value: { string_value: "2" }' in text
    assert engine_arguments({"tensor_parallel_size": {"string_value": "2"}})[1] == {"tensor_parallel_size": 2}
