"""Instance groups. Without a server: where an instance runs (KIND_GPU: its own cuda:N) and its share of the
cores and KV budget; how `serve --instances` writes config.pbtxt; per-instance metric samples.

Through tritonserver with `instance_group [{count: 2, kind: KIND_CPU}]`: two stub processes, two engines, each
with half the cores and half the KV pool; concurrent streams spread over both and each equals its solo output;
each instance's gauges under its own `instance` label; SIGTERM stops both."""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.backend.triton.instances import Instance, instance_device, instance_engine_kwargs
from pagedserve.backend.worker.model_runner import CPU_KV_CACHE_BYTES
from pagedserve.client import launcher
from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    instance_metrics,
    model_metric,
    prepare_model_repository,
    process_group_members,
    set_instance_group,
)
from tests.support.faults import PACE_MARKER, install_fault_model
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

INSTANCES = 2
NUM_BLOCKS = 1024  # each instance holds all NUM_LONG long requests: none is preempted while they are counted
PARAMS = {**CPU_FP32, "num_blocks": str(NUM_BLOCKS), "max_model_len": "1024", "max_num_seqs": "16"}
NUM_STREAMS = 16
# Greedy and seeded sampling: both must come out of either engine, batched or alone, token for token.
PARAMS_OF = [{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
             {"temperature": 0.8, "seed": 11, "max_tokens": 16, "ignore_eos": True}]
LONG = {"temperature": 0.0, "max_tokens": 1000, "ignore_eos": True}
NUM_LONG = 8
LIVENESS_SECONDS = 60
E2E_COUNT = "vllm:e2e_request_latency_seconds_count"


def _instance(kind: str = "CPU", device_id: int = 0, groups: list[dict] | None = None) -> Instance:
    args = {"model_name": "llm", "model_instance_name": f"llm_0_{device_id}", "model_instance_kind": kind,
            "model_instance_device_id": str(device_id)}
    return Instance.from_args(args, {"instance_group": groups or [{"kind": f"KIND_{kind}", "count": 1}]})


def test_peers_are_the_instances_on_the_same_device():
    cpu = [{"name": "llm_0", "kind": "KIND_CPU", "count": 3, "gpus": []}]
    assert _instance("CPU", groups=cpu).peers == 3
    gpus = [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}, {"kind": "KIND_GPU", "count": 1, "gpus": [1]}]
    assert (_instance("GPU", 0, gpus).peers, _instance("GPU", 1, gpus).peers) == (2, 3)
    assert _instance("CPU", groups=[*cpu, *gpus]).peers == 3
    assert Instance.from_args({"model_name": "llm"}, {}) == Instance("llm", "CPU", 0, 1)


@pytest.mark.parametrize(("kind", "configured", "cuda", "device"), [
    ("CPU", "auto", False, "cpu"),
    ("CPU", "auto", True, "cuda"),  # one KIND_CPU instance drives the GPU, as before instance groups
    ("CPU", "cpu", True, "cpu"),
    ("MODEL", "cuda:1", True, "cuda:1"),
    ("GPU", "auto", True, "cuda:3"),
    ("GPU", "cuda", True, "cuda:3"),
    ("GPU", "cuda:3", True, "cuda:3"),
])
def test_a_kind_gpu_instance_runs_on_its_own_device(kind, configured, cuda, device):
    assert instance_device(_instance(kind, 3), configured, cuda_available=cuda) == device


@pytest.mark.parametrize(("configured", "cuda", "says"), [
    ("cpu", True, "parameter device is 'cpu'"), ("cuda:0", True, "parameter device is 'cuda:0'"),
    ("auto", False, "torch sees no CUDA")])
def test_a_kind_gpu_instance_refuses_another_device_or_none(configured, cuda, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        instance_device(_instance("GPU", 3), configured, cuda_available=cuda)


def _two(kind: str = "CPU") -> Instance:
    return _instance(kind, 0, [{"kind": f"KIND_{kind}", "count": 2, "gpus": [0] if kind == "GPU" else []}])


def test_one_instance_keeps_its_settings():
    kwargs = {"num_blocks": 64, "dtype": "float32"}
    assert instance_engine_kwargs(kwargs, _instance(), "cpu", cores=8) == {**kwargs, "device": "cpu"}


def test_cpu_instances_split_the_cores_and_the_kv_budget():
    assert instance_engine_kwargs({"num_blocks": 65}, _two(), "cpu", cores=8) == {
        "num_blocks": 32, "cpu_threads": 4, "device": "cpu"}
    assert instance_engine_kwargs({"cpu_threads": 6, "kv_cache_memory_bytes": 1000}, _two(), "cpu", cores=2) == {
        "cpu_threads": 3, "kv_cache_memory_bytes": 500, "device": "cpu"}
    # Neither size given: each takes half the CPU default budget; a single core is still one thread each.
    assert instance_engine_kwargs({}, _two(), "cpu", cores=1) == {
        "cpu_threads": 1, "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES // 2, "device": "cpu"}


def test_gpu_instances_sharing_a_device_need_an_explicit_kv_size():
    assert instance_engine_kwargs({"kv_cache_memory_bytes": 2 << 30}, _two("GPU"), "cuda:0", cores=8) == {
        "kv_cache_memory_bytes": 1 << 30, "device": "cuda:0"}
    with pytest.raises(ValueError, match="share cuda:0: set config.pbtxt parameter num_blocks or kv_cache"):
        instance_engine_kwargs({"gpu_memory_utilization": 0.9}, _two("GPU"), "cuda:0", cores=8)
    with pytest.raises(ValueError, match="num_blocks = 1 cannot be shared by 2 instances"):
        instance_engine_kwargs({"num_blocks": 1}, _two(), "cpu", cores=8)


CONFIG = """backend: "python"
# instance_group [ { count: 9 } ] in a comment stays
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0, 1 ] } ]
parameters { key: "model" value: { string_value: "" } }
"""


def _group_of(text: str) -> str:
    return re.search(r"^instance_group.*$", text, re.MULTILINE).group(0)


def test_set_instance_group_writes_one_group_keeping_the_kind_unless_told():
    assert _group_of(set_instance_group(CONFIG, 4)) == "instance_group [ { count: 4 kind: KIND_GPU } ]"
    assert _group_of(set_instance_group(CONFIG, 2, "KIND_CPU")) == "instance_group [ { count: 2 kind: KIND_CPU } ]"
    assert set_instance_group(CONFIG, 2).replace("count: 2 kind: KIND_GPU }", "count: 1 kind: KIND_GPU gpus: [ 0, 1 ] }") == CONFIG
    without = CONFIG.replace(_group_of(CONFIG) + "\n", "")
    assert _group_of(set_instance_group(without, 3)) == "instance_group [ { count: 3 kind: KIND_CPU } ]"
    with pytest.raises(ValueError, match="at least 1"):
        set_instance_group(CONFIG, 0)


def test_serve_instances_sets_the_llm_models_group_only(tmp_path):
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert launcher.llm_instances(parser.parse_args([])) is None
    assert launcher.llm_instances(parser.parse_args(["--instances", "2"])) == (2, None)
    assert launcher.llm_instances(parser.parse_args(["--instances", "2", "--instance-kind", "gpu"])) == (2, "KIND_GPU")
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "repo", "/m", None, (2, None))
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in (repository / "llm" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in (repository / "ensemble" / "config.pbtxt").read_text()


METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{instance="llm_0_1",model="llm",version="1"} 3
vllm:num_requests_running{instance="llm_0_0",model="llm",version="1"} 2
vllm:num_requests_running{instance="other_0",model="other",version="1"} 7
"""


def test_a_models_metric_is_the_sum_of_its_instances():
    assert instance_metrics(METRICS, "vllm:num_requests_running") == {"llm_0_1": 3.0, "llm_0_0": 2.0}
    assert model_metric(METRICS, "vllm:num_requests_running") == 5.0
    assert model_metric(METRICS, "vllm:num_requests_waiting") == 0.0


@pytest.fixture(scope="module")
def two_instances(tiny_llama_path, tmp_path_factory) -> Iterator[RunningTriton]:
    """The llm model alone (the fault model: PACE_MARKER slows a request's steps), two KIND_CPU instances; the
    module's last test stops it."""
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp("instance-groups"), PARAMS, llm_only=True,
                        instances=INSTANCES, adapt_repository=install_fault_model) as running:
        yield running


def _log(running: RunningTriton) -> str:
    return running.log_path.read_text(errors="replace")


def _until(condition, what) -> None:
    """Poll `condition` until it holds; `what()` explains a failure (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + LIVENESS_SECONDS
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


@pytest.mark.slow
def test_each_instance_is_its_own_engine_with_half_the_cores_and_half_the_kv_pool(two_instances):
    shares = dict(re.findall(r"pagedserve: instance (llm_0_\d) \(CPU, one of 2 on its device\) runs on cpu (\{.*?\})",
                             _log(two_instances)))
    threads = max(1, len(os.sched_getaffinity(0)) // INSTANCES)
    expected = str({"cpu_threads": threads, "num_blocks": NUM_BLOCKS // INSTANCES})
    assert shares == {"llm_0_0": expected, "llm_0_1": expected}
    gauges = two_instances.instance_metrics("vllm:kv_cache_usage_perc")
    assert sorted(gauges) == ["llm_0_0", "llm_0_1"]


def _text(running: RunningTriton, index: int, stream: bool) -> str:
    result = running.grpc_stream("llm", {
        "text_input": f"Request {index}: the quick brown fox number {index * 7}", "stream": stream,
        "sampling_parameters": PARAMS_OF[index % 2], "exclude_input_in_output": True})
    assert result.error is None, result.error
    return "".join(result.texts())


@pytest.mark.slow
def test_concurrent_streams_spread_over_both_instances_and_each_equals_its_solo_output(two_instances):
    solo = [_text(two_instances, i, stream=False) for i in range(NUM_STREAMS)]
    before = two_instances.instance_metrics(E2E_COUNT)
    with ThreadPoolExecutor(max_workers=NUM_STREAMS) as pool:
        together = list(pool.map(lambda i: _text(two_instances, i, stream=True), range(NUM_STREAMS)))
    assert together == solo
    after = two_instances.instance_metrics(E2E_COUNT)
    served = {name: after[name] - before.get(name, 0.0) for name in after}
    # Triton hands each request to a free instance; both took a part of the burst, and they add up.
    assert sum(served.values()) == NUM_STREAMS and min(served.values()) > 0, served


@pytest.mark.slow
def test_each_instance_reports_its_own_running_requests_under_its_label(two_instances):
    running = two_instances
    # Paced (each of their steps PACE_SECONDS longer): the first streams must still run when the last one starts.
    streams = [running.open_stream("llm", {"text_input": f"Long story {i} {PACE_MARKER}:", "stream": True,
                                           "sampling_parameters": LONG}) for i in range(NUM_LONG)]
    seen: dict[str, float] = {}
    totals: list[float] = []

    def both_seen_and_all_counted() -> bool:
        # Polled, not at one instant: the streams may reach the two engines (and end) at different times.
        gauges = running.instance_metrics("vllm:num_requests_running")
        for name, value in gauges.items():
            seen[name] = max(seen.get(name, 0.0), value)
        totals.append(sum(gauges.values()))
        return len(seen) == INSTANCES and min(seen.values()) > 0 and max(totals) == NUM_LONG

    try:
        # Without the label the two engines would overwrite one gauge; with it both show, adding up to all.
        _until(both_seen_and_all_counted, lambda: f"peaks {seen}, totals up to {max(totals, default=0)}; "
                                                  f"{_log(running)[-3000:]}")
    finally:
        for stream in streams:
            stream.close(cancel=True)
    running.wait_idle()  # both engines freed every block of the cancelled streams


@pytest.mark.slow
def test_sigterm_stops_both_instances_cleanly(two_instances):
    server = two_instances.server
    pgid = server.process.pid
    server.process.send_signal(signal.SIGTERM)
    # tritonserver exits by itself (status 0) once it unloaded both instances, one after the other.
    assert server.process.wait(timeout=LIVENESS_SECONDS) == 0, _log(two_instances)[-3000:]
    log = _log(two_instances)
    assert "Exit timeout expired" not in log and "Segfault" not in log, log[-3000:]
    assert "successfully unloaded 'llm' version 1" in log
    server.stop()  # what `pagedserve serve` does after: nothing is left of the two stubs to kill
    _until(lambda: not process_group_members(pgid), lambda: f"left behind: {process_group_members(pgid)}")
