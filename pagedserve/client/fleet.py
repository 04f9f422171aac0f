"""`pagedserve serve --data-parallel-size N`: N engines behind a router people already run.

Each replica is its own tritonserver (pinned to its share of the cores, its own KV budget) with its own
OpenAI shim; the OpenAI port is vllm-router's (PyPI `vllm-router`, vLLM's Rust router): it routes by
prefix (`cache_aware`: from the request text it has routed), in turn (`round_robin`), or by what each engine
has actually cached (`kv_events`: its `kv_aware` policy fed by our KV cache events over ZMQ). Each engine
runs with its data-parallel rank: its metrics' `engine` label and its KV events' `data_parallel_rank`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# --router's names -> vllm-router's --policy names.
ROUTER_POLICIES = {"round_robin": "round_robin", "cache_aware": "cache_aware", "kv_events": "kv_aware"}
ROUTER_BINARY = "vllm-router"
DEFAULT_BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register serve's data-parallel options."""
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                        help="serve N engines (each its own tritonserver on its share of the cores) behind "
                        "vllm-router on the OpenAI port")
    parser.add_argument("--router", choices=tuple(ROUTER_POLICIES), default="cache_aware",
                        help="with --data-parallel-size > 1: vllm-router's policy; kv_events routes by the "
                        "engines' own KV cache events (vllm-router kv_aware)")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what a fleet cannot be, naming the flag."""
    if args.data_parallel_size < 1:
        raise SystemExit(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.no_openai:
        raise SystemExit("--data-parallel-size > 1 serves through the router on the OpenAI port: drop --no-openai")


def router_binary() -> str:
    """The vllm-router executable beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / ROUTER_BINARY
    found = str(beside) if beside.exists() else shutil.which(ROUTER_BINARY)
    if found is None:
        raise SystemExit("--data-parallel-size needs vllm-router: pip install 'pagedserve[server]'")
    return found


def core_groups(size: int, cores: Sequence[int] | None = None) -> list[list[int]]:
    """The usable cores split into `size` contiguous groups (a core is shared only when there are fewer)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if size <= len(cores):
        base, extra = divmod(len(cores), size)
        groups, start = [], 0
        for rank in range(size):
            end = start + base + (rank < extra)
            groups.append(cores[start:end])
            start = end
        return groups
    return [[cores[rank % len(cores)]] for rank in range(size)]


def consecutive_free_ports(count: int, attempts: int = 50) -> int:
    """A first port P such that P .. P + count - 1 were all free on loopback a moment ago."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


@dataclass
class ReplicaPlan:
    """One engine of the fleet: its rank, cores, ports and llm parameters."""

    rank: int
    cores: list[int]
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int
    params: dict[str, str]

    @property
    def worker_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"


def kv_events_params(params: dict[str, str], size: int) -> tuple[dict[str, str], str | None, str | None]:
    """(the llm parameters with events on, the rank-0 event endpoint, the rank-0 replay endpoint) for a
    kv_events fleet; a kv_events_config already given is kept (each engine offsets its ports by its rank)."""
    given = params.get("kv_events_config")
    config = json.loads(given) if given else {}
    if not config.get("endpoint"):
        config["endpoint"] = f"tcp://*:{consecutive_free_ports(size)}"
    if not config.get("replay_endpoint"):
        config["replay_endpoint"] = f"tcp://*:{consecutive_free_ports(size)}"
    config["enable_kv_cache_events"] = True
    return ({**params, "kv_events_config": json.dumps(config)}, config["endpoint"], config["replay_endpoint"])


def plan_replicas(size: int, params: dict[str, str]) -> list[ReplicaPlan]:
    """Ports, cores and parameters of each of `size` replicas (rank r: data_parallel_rank r)."""
    from pagedserve.client.launcher import free_loopback_ports

    plans = []
    for rank, cores in enumerate(core_groups(size)):
        http, grpc, metrics, openai = free_loopback_ports(4)
        replica_params = {**params, "data_parallel_rank": str(rank)}
        replica_params.setdefault("cpu_threads", str(len(cores)))
        plans.append(ReplicaPlan(rank, cores, http, grpc, metrics, openai, replica_params))
    return plans


def router_command(args: argparse.Namespace, plans: Sequence[ReplicaPlan], tokenizer: Path,
                   events: tuple[str, str] | None, block_size: int, prometheus_port: int) -> list[str]:
    """vllm-router's command line for the fleet."""
    from pagedserve.backend.core.kv_events import offset_endpoint

    cmd = [router_binary(), "--host", args.host, "--port", str(args.openai_port),
           "--policy", ROUTER_POLICIES[args.router], "--prometheus-port", str(prometheus_port),
           "--worker-urls", *(plan.worker_url for plan in plans)]
    if events is not None:
        for plan in plans:
            endpoint, replay = (offset_endpoint(e, plan.rank).replace("*", "127.0.0.1") for e in events)
            cmd += ["--kv-event-source", f"{plan.worker_url}={endpoint}",
                    "--kv-event-replay-source", f"{plan.worker_url}={replay}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", str(tokenizer)]
    return cmd


def pinned(command: list[str], cores: Sequence[int]) -> list[str]:
    """`command` confined to `cores` (taskset), so replicas do not contend for one core."""
    if shutil.which("taskset") is None:
        return command
    return ["taskset", "-c", ",".join(map(str, cores)), *command]


def start_router(command: list[str], log_file: Path) -> subprocess.Popen:
    """The router in its own process group, its log in `log_file`."""
    from pagedserve.client.launcher import _die_with_parent

    with open(log_file, "ab") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)


def _pinned_server(cores: Sequence[int], repository: Path, work_dir: Path, plan: ReplicaPlan):
    """A TritonServer for one replica whose processes (server and Python stubs) run on `cores`."""
    from pagedserve.client.launcher import TritonServer

    class PinnedTritonServer(TritonServer):
        def command(self) -> list[str]:
            return pinned(super().command(), cores)

    return PinnedTritonServer(repository, work_dir=work_dir, host="127.0.0.1", http_port=plan.http_port,
                              grpc_port=plan.grpc_port, metrics_port=plan.metrics_port,
                              log_file=work_dir / "tritonserver.log")


def _start_replicas(args: argparse.Namespace, plans: Sequence[ReplicaPlan], model: str, naming: Sequence[str],
                    root: Path, servers: list, shims: list) -> None:
    """Start every replica's server, then its shim once the server is ready (appending to servers/shims)."""
    from pagedserve.client import launcher

    for plan in plans:
        work = root / f"rank{plan.rank}"
        work.mkdir()
        repository = launcher.prepare_model_repository(
            args.model_repository, work / "models", model, plan.params, launcher.llm_instances(args),
            launcher.lora_modules(args))
        server = _pinned_server(plan.cores, repository, work, plan)
        server.start()
        servers.append(server)
    for server, plan in zip(servers, plans, strict=True):
        server.wait_ready(args.ready_timeout)
        shims.append(launcher.spawn_openai_shim(
            server.grpc_url, server.metrics_url, "127.0.0.1", plan.openai_port, "--model", model, *naming,
            *launcher._tool_flags(args), *launcher.lora_shim_flags(args), start_new_session=True,
            preexec_fn=launcher._die_with_parent))
    for shim, plan in zip(shims, plans, strict=True):
        launcher.wait_for_http_ok(f"{plan.worker_url}/health", shim, args.ready_timeout)


def _supervise(router: subprocess.Popen, servers: Sequence) -> int:
    """Serve until the router exits or every replica has; a replica that dies is reported (the router routes
    around it)."""
    import time

    reported: set[int] = set()
    while router.poll() is None:
        for rank, server in enumerate(servers):
            if server.process.poll() is not None and rank not in reported:
                reported.add(rank)
                print(f"replica {rank} exited ({server.process.returncode}); the router routes around it",
                      flush=True)
        if len(reported) == len(servers):
            return 1
        time.sleep(1.0)
    return router.returncode


def run(args: argparse.Namespace, params: dict[str, str], model: str, naming: Sequence[str]) -> int:
    """Serve the fleet until Ctrl-C / SIGTERM or until the router exits; returns the exit status."""
    import tempfile

    from pagedserve.client import launcher
    from pagedserve.client.model_repository import tokenizer_folder

    size = args.data_parallel_size
    events = None
    if args.router == "kv_events":
        params, endpoint, replay = kv_events_params(params, size)
        events = (endpoint, replay)
    block_size = int(params.get("block_size") or DEFAULT_BLOCK_SIZE)
    plans = plan_replicas(size, params)
    servers: list = []
    shims: list[subprocess.Popen] = []
    router = None
    with tempfile.TemporaryDirectory(prefix="pagedserve-fleet-") as tmp:
        root = Path(tmp)
        try:
            _start_replicas(args, plans, model, naming, root, servers, shims)
            command = router_command(args, plans, tokenizer_folder(model), events, block_size,
                                     launcher.free_loopback_ports(1)[0])
            router = start_router(command, root / "router.log")
            public = f"http://{launcher._client_host(args.host)}:{args.openai_port}"
            launcher.wait_for_http_ok(f"{public}/health", router, args.ready_timeout)
            print(f"pagedserve is serving {model} on {size} engines behind vllm-router ({args.router})", flush=True)
            for plan, server in zip(plans, servers, strict=True):
                print(f"  engine {plan.rank}: cores {plan.cores}, OpenAI {plan.worker_url}/v1, metrics "
                      f"http://127.0.0.1:{plan.metrics_port}/metrics, tritonserver pid {server.process.pid}",
                      flush=True)
            print(f"  OpenAI  {public}/v1 (the router)", flush=True)
            print("Ctrl-C stops it.", flush=True)
            return _supervise(router, servers)
        except KeyboardInterrupt:
            return 0
        finally:
            launcher._stop_process_group(router)
            for shim in shims:
                launcher._stop_process_group(shim)
            for server in servers:
                server.stop()
