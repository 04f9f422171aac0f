"""The tensor-parallel worker processes: rank 0 (the engine's process) spawns ranks 1..N-1, each of which builds
its ModelRunner (its shard and its KV heads) and runs every step plan rank 0 broadcasts (the forward, then its
vocabulary shard of the plan's logits rows) until told to stop.

Several nodes: rank 0's node sets MASTER_ADDR / MASTER_PORT (an address the others reach) and LOCAL_WORLD_SIZE
(the ranks it runs, 0..L-1); each other rank runs `python -m pagedserve.backend.worker.tp_workers` with the same
MASTER_ADDR / MASTER_PORT, its RANK and LOCAL_RANK (its device on its node), and reads the engine's configs from
the rendezvous store (the model folder, and any LoRA adapter folder, must be at the same path)."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import socket
import sys
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from pagedserve import kernels
from pagedserve.backend.core.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.worker.model_runner import ModelRunner, resolve_device
from pagedserve.backend.worker.parallel import (
    StepPlan,
    TensorParallel,
    TensorParallelError,
    check_tensor_parallel,
    open_store,
)

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_SECONDS = 10.0
_CONFIGS = "pagedserve/configs"  # the store key of the pickled (model, cache, scheduler, LoRA) configs


def rendezvous(environ: dict[str, str] | None = None) -> str:
    """torch.distributed's init method: tcp://MASTER_ADDR:MASTER_PORT when the environment names them (the
    address other nodes' ranks reach), else a free port on the loopback."""
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return f"tcp://{environ['MASTER_ADDR']}:{int(environ['MASTER_PORT'])}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the CUDA device `rank` places after the configured one."""
    base = resolve_device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class TPWorkers:
    """Rank 0's side: the worker processes, the group, and stopping both."""

    def __init__(self, processes: list[BaseProcess]):
        self.processes = processes
        self.group: TensorParallel | None = None

    @classmethod
    def launch(cls, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
               lora_config: LoRAConfig | None = None, init_method: str | None = None) -> TPWorkers:
        """Spawn ranks 1..N-1 and join the group as rank 0 (the rendezvous waits for all of them)."""
        world = model_config.tensor_parallel_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
        if not 1 <= local <= world:
            raise ValueError(f"LOCAL_WORLD_SIZE must be in [1, tensor_parallel_size {world}], got {local}")
        init_method = init_method or rendezvous()
        store = open_store(init_method, is_master=True)
        store.set(_CONFIGS, pickle.dumps((model_config, cache_config, scheduler_config, lora_config)))
        context = multiprocessing.get_context("spawn")
        if not os.path.basename(sys.executable).startswith("python"):  # a host such as Triton's stub
            context.set_executable(os.path.join(sys.prefix, "bin", "python3"))
        processes = []
        for rank in range(1, local):
            process = context.Process(target=worker_main, name=f"pagedserve-tp{rank}", daemon=True,
                                      args=(rank, init_method))
            process.start()
            processes.append(process)
        workers = cls(processes)
        try:
            workers.group = TensorParallel(0, world, store, rank_device(model_config.device, 0),
                                           liveness=workers.dead_worker)
        except BaseException:
            _end(processes)
            raise
        logger.info("tensor parallelism: %d ranks over %s (%s)", world, init_method, dist_backend(workers.group))
        return workers

    def dead_worker(self, wait: float) -> str | None:
        """A description of the first worker that exited, waiting up to `wait` seconds for one to; None if none."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(wait)
            if not process.is_alive():
                return f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def stop(self) -> None:
        """Tell the workers to stop, join them (ending those that linger), leave the group; once."""
        if not dist.is_initialized():
            return
        if self.group.failure is None:
            try:
                self.group.broadcast(None)
            except TensorParallelError:
                logger.warning("tensor-parallel workers could not be told to stop: %s", self.group.failure)
        _end(self.processes)
        self.group.close()


def dist_backend(group: TensorParallel) -> str:
    """The group's backend name, for the log."""
    return "nccl" if group.device.type == "cuda" else "gloo"


def _end(processes: list[BaseProcess]) -> None:
    """Join each process, terminating (then killing) one that does not exit in time."""
    for process in processes:
        process.join(JOIN_TIMEOUT_SECONDS)
        if process.is_alive():
            process.terminate()
            process.join(JOIN_TIMEOUT_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


def with_rank_threads(model_config: ModelConfig) -> ModelConfig:
    """On the CPU without cpu_threads, each of the N ranks of this node takes 1/N of the cores it may use (not
    all of them each, which would oversubscribe them N times)."""
    if model_config.cpu_threads is not None or rank_device(model_config.device, 0).type != "cpu":
        return model_config
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or model_config.tensor_parallel_size)
    return dataclasses.replace(model_config, cpu_threads=max(1, len(os.sched_getaffinity(0)) // local))


def start_runner(model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 lora_config: LoRAConfig | None) -> tuple[ModelRunner, TPWorkers | None]:
    """The engine's ModelRunner; with tensor_parallel_size > 1 rank 0's, its workers started (and stopped again
    should rank 0's start fail)."""
    if model_config.tensor_parallel_size == 1:
        return ModelRunner(model_config, cache_config, scheduler_config, lora_config), None
    check_tensor_parallel(model_config)
    model_config = with_rank_threads(model_config)
    workers = TPWorkers.launch(model_config, cache_config, scheduler_config, lora_config)
    try:
        return ModelRunner(model_config, cache_config, scheduler_config, lora_config, workers.group), workers
    except BaseException:
        workers.group.close()  # a worker waiting in a collective sees the connection close and exits
        _end(workers.processes)
        raise


def worker_main(rank: int, init_method: str, local_rank: int | None = None,
                timeout: float | None = None) -> None:
    """Rank `rank`'s process: read the configs rank 0 published, join the group, build its runner, run each
    broadcast plan until None. `local_rank` (default `rank`) places it on its node's devices."""
    store = open_store(init_method, is_master=False, timeout=timeout)
    model_config, cache_config, scheduler_config, lora_config = pickle.loads(store.get(_CONFIGS))
    device = rank_device(model_config.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton kernels launch on the current device
    group = TensorParallel(rank, model_config.tensor_parallel_size, store, device, timeout)
    try:
        runner = ModelRunner(model_config, cache_config, scheduler_config, lora_config, group)
        while (plan := group.broadcast(None)) is not None:
            with torch.inference_mode():
                _mirror_lora(runner, plan, rank)
                kernels.copy_blocks(runner.key_caches, runner.value_caches, plan.block_copies)
                hidden = runner.model(plan.input_ids.to(device), plan.positions.to(device), runner.kv_caches,
                                      plan.meta(device))
                runner.model.compute_logits(hidden[plan.logit_rows.to(device)])  # joins the logits' gather
    except TensorParallelError as error:
        logger.error("tensor-parallel rank %d stops: %s", rank, error)
        sys.exit(1)
    finally:
        group.close()


def _mirror_lora(runner: ModelRunner, plan: StepPlan, rank: int) -> None:
    """Make rank 0's LoRA decisions of the plan on this rank. A folder this rank cannot read (another node's
    path) stops it: rank 0, waiting in the step's first collective, fails the step with this reason."""
    if runner.lora is None or plan.lora is None:
        return
    try:
        runner.lora.mirror(plan.lora)
    except InvalidRequestError as error:
        reason = f"rank {rank} cannot load a LoRA adapter rank 0 loaded: {error}"
        runner.tp.report(reason)
        raise TensorParallelError(reason) from error


def main() -> None:
    """A rank on another node, from the environment: MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK."""
    logging.basicConfig(level=logging.INFO)
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise SystemExit("a tensor-parallel rank needs MASTER_ADDR and MASTER_PORT (rank 0's rendezvous)")
    worker_main(int(os.environ["RANK"]), rendezvous(), int(os.environ.get("LOCAL_RANK", "0")))


if __name__ == "__main__":
    main()
