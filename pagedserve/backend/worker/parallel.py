"""Tensor parallelism over torch.distributed: one rank's process group (gloo on the CPU, NCCL on CUDA with a gloo
group beside it for the step plans), the collectives its sharded model's layers join (model/parallel_layers.py),
and the step plan rank 0 broadcasts so every rank runs the same forward and the same logits rows."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pagedserve.backend.core.config import ModelConfig
from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.model import ModelArchConfig
from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.parallel_layers import load_parallel_model
from pagedserve.backend.model.quant_formats import scheme_from_config
from pagedserve.backend.model.sharding import TP_ARCHITECTURES, indivisible_field

logger = logging.getLogger(__name__)

# How long a collective (a step's all-reduce, the start-up rendezvous) may wait for a rank; the environment's
# PAGEDSERVE_TP_TIMEOUT_SECONDS overrides it (spawned ranks inherit it).
COLLECTIVE_TIMEOUT_SECONDS = 120.0
TIMEOUT_ENV = "PAGEDSERVE_TP_TIMEOUT_SECONDS"
# Joining waits on a worker's start (spawn, imports), not on a collective, so a short collective timeout must
# not fail a slow but live start; a worker that exits first is noticed at once either way.
STARTUP_TIMEOUT_SECONDS = 300.0
# A worker waits for rank 0's next plan as long as the engine idles: no timeout (a dead rank 0 still ends it).
_PLAN_WAIT = timedelta(days=3650)


def collective_timeout() -> float:
    """Seconds a collective may wait: PAGEDSERVE_TP_TIMEOUT_SECONDS, else COLLECTIVE_TIMEOUT_SECONDS."""
    return float(os.environ.get(TIMEOUT_ENV) or COLLECTIVE_TIMEOUT_SECONDS)


class TensorParallelError(RuntimeError):
    """A rank is gone or a collective failed: the engine cannot run another step and must be restarted."""


def check_tensor_parallel(model_config: ModelConfig) -> None:
    """Refuse, naming the field, what tensor_parallel_size > 1 cannot serve: a GGUF file, a quantized checkpoint, a
    family not in TP_ARCHITECTURES, a size the ranks cannot split, quantization at load."""
    world = model_config.tensor_parallel_size
    if str(model_config.model).endswith(".gguf"):
        raise ConfigError(f"tensor_parallel_size {world} is not supported for GGUF files",
                                  "tensor_parallel_size")
    if scheme_from_config(json.loads((Path(model_config.model) / "config.json").read_text())) is not None:
        raise ConfigError(f"tensor_parallel_size {world} is not supported for quantized checkpoints",
                                  "tensor_parallel_size")
    arch = ModelArchConfig.from_pretrained(model_config.model)
    if arch.architecture not in TP_ARCHITECTURES:
        raise ConfigError(f"tensor_parallel_size {world} is not supported for {arch.architecture}; "
                                  f"supported: {', '.join(TP_ARCHITECTURES)}", "tensor_parallel_size")
    bad = indivisible_field(arch, world)
    if bad is not None:
        raise ConfigError(f"tensor_parallel_size {world} does not divide the model's {bad[0]} ({bad[1]})",
                                  "tensor_parallel_size")
    if model_config.quantization != "none":
        raise ConfigError(f"quantization {model_config.quantization!r} is not supported with "
                                  f"tensor_parallel_size {world}", "quantization")


@dataclass(slots=True)
class LoRAPlan:
    """Rank 0's LoRA decisions, which every worker mirrors before the step's forward: the adapters rank 0 loaded
    into slots since the last plan (each worker reads the folder itself, at the same path, and copies in its
    shard), the load ids it forgot, and the step's per-row slots (None: no row has an adapter) and in-use mask."""

    loads: list[tuple[int, int, str, str]]  # (slot, load id, name, path), in the order rank 0 made them
    removed: list[int]
    slots: torch.Tensor | None  # [T] int32 on the CPU, -1 = base model
    active: int  # bit s set: slot s has rows in this step


@dataclass(slots=True)
class StepPlan:
    """What every rank needs to run rank 0's step: block copies, its LoRA decisions (None: LoRA off), then one
    forward over these CPU tensors and the logits of its `logit_rows` (whose gather every rank joins)."""

    block_copies: list[tuple[int, int]]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [S, max_blocks]
    cu_seqlens_q: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    max_seqlen_q: int
    max_seqlen_k: int
    logit_rows: torch.Tensor  # [R] hidden rows the step computes logits of
    lora: LoRAPlan | None = None
    bidirectional_ranges: torch.Tensor | None = None  # [T, 2]: Gemma 3's image runs (AttentionMetadata's)

    @classmethod
    def of(cls, block_copies: list[tuple[int, int]], input_ids: torch.Tensor, positions: torch.Tensor,
           meta: AttentionMetadata, logit_rows: torch.Tensor, lora: LoRAPlan | None = None) -> StepPlan:
        """The plan of a prepared step (its tensors brought to the CPU)."""
        cpu = [t.cpu() for t in (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q,
                                 meta.seq_lens)]
        ranges = None if meta.bidirectional_ranges is None else meta.bidirectional_ranges.cpu()
        return cls(list(block_copies), *cpu, meta.max_seqlen_q, meta.max_seqlen_k, logit_rows.cpu(), lora, ranges)

    def meta(self, device: torch.device) -> AttentionMetadata:
        """The attention metadata on `device`."""
        return AttentionMetadata(self.slot_mapping.to(device), self.block_tables.to(device),
                                 self.cu_seqlens_q.to(device), self.seq_lens.to(device), self.max_seqlen_q,
                                 self.max_seqlen_k, None if self.bidirectional_ranges is None
                                 else self.bidirectional_ranges.to(device))


class TensorParallel:
    """One rank's membership of the tensor-parallel group. Rank 0 broadcasts each step's plan; the others
    receive it. Once a collective fails every later call raises the same TensorParallelError."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, device: torch.device,
                 timeout: float | None = None, liveness: Liveness | None = None):
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; one tensor-parallel "
                               "engine per process")
        self.rank, self.world_size, self.device, self.store = rank, world_size, device, store
        timeout = collective_timeout() if timeout is None else timeout
        self.failure: str | None = None
        # Rank 0's probe of its workers: given seconds to wait for one to exit, a description of a dead one.
        self.liveness: Liveness = liveness or (lambda wait: None)
        if rank:
            store.add(_JOINED, 1)
        else:
            _wait_for_ranks(store, world_size, max(timeout, STARTUP_TIMEOUT_SECONDS), self.liveness)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # The plans go over a gloo group of their own (NCCL moves tensors only), which never times out.
        self.plan_group = dist.new_group(backend="gloo", timeout=_PLAN_WAIT)

    def load_model(self, path: str | Path, dtype: torch.dtype, max_position: int) -> nn.Module:
        """This rank's shard of the model, its layers joined over the group (model/parallel_layers.py)."""
        return load_parallel_model(path, dtype, self.device, max_position, self)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks in place."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            dist.all_reduce(tensor)
        except Exception as error:  # noqa: BLE001 - gloo and NCCL raise several kinds
            self._fail(error)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (all of one shape) on rank 0, in rank order; None on the other ranks."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            dist.gather(tensor, parts, dst=0)
        except Exception as error:  # noqa: BLE001 - gloo and NCCL raise several kinds
            self._fail(error)
        return parts

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The fewest KV blocks any rank can hold: every rank's cache takes the same block ids."""
        value = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        self._check()
        try:
            dist.all_reduce(value, op=dist.ReduceOp.MIN)
        except Exception as error:  # noqa: BLE001
            self._fail(error)
        return int(value.item())

    def broadcast(self, plan: StepPlan | None) -> StepPlan | None:
        """Rank 0 sends `plan` (None: stop); the others get it."""
        self._check()
        box = [plan]
        try:
            dist.broadcast_object_list(box, src=0, group=self.plan_group)
        except Exception as error:  # noqa: BLE001
            self._fail(error)
        return box[0]

    def report(self, reason: str) -> None:
        """A worker's last word before it exits: rank 0 adds it to the failure it reports."""
        try:
            self.store.set(f"{_REASON}{self.rank}", reason)
        except Exception:  # noqa: BLE001 - rank 0 (the store's server) may be gone already
            logger.debug("rank %d could not report why it stops", self.rank)

    def _dead(self, wait: float) -> str | None:
        """The liveness probe's dead worker, with the reasons any worker reported before exiting."""
        dead = self.liveness(wait)
        if dead is None:
            return None
        keys = [f"{_REASON}{rank}" for rank in range(1, self.world_size)]
        reasons = [self.store.get(key).decode() for key in keys if self.store.check([key])]
        return ": ".join([dead, *reasons])

    def close(self) -> None:
        """Leave the group."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def _check(self) -> None:
        """Raise once the group has failed, or (rank 0) a worker is found dead before the next collective."""
        if self.failure is None:
            dead = self._dead(0.0)
            if dead is not None:
                self.failure = dead + _CANNOT_CONTINUE
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def _fail(self, error: BaseException) -> None:
        cause = self._dead(1.0) or f"a tensor-parallel collective failed on rank {self.rank}: {error}"
        self.failure = cause + _CANNOT_CONTINUE
        raise TensorParallelError(self.failure) from error


def open_store(init_method: str, is_master: bool, timeout: float | None = None) -> dist.TCPStore:
    """The rendezvous store at tcp://HOST:PORT, which rank 0 serves and every other rank connects to."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if not init_method.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"tensor-parallel init method must be tcp://HOST:PORT, got {init_method!r}")
    timeout = collective_timeout() if timeout is None else timeout
    return dist.TCPStore(host, int(port), is_master=is_master, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def _wait_for_ranks(store: dist.Store, world_size: int, timeout: float, liveness: Liveness) -> None:
    """Return once every other rank has joined; fail at once (not at the timeout) when a worker exits first."""
    deadline = time.monotonic() + timeout
    while store.add(_JOINED, 0) < world_size - 1:
        dead = liveness(0.0)
        if dead is not None:
            raise TensorParallelError(f"{dead} before joining the group")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"{world_size - 1 - store.add(_JOINED, 0)} tensor-parallel ranks did not "
                                      f"join within {timeout:g} s")
        time.sleep(0.05)


Liveness = Callable[[float], "str | None"]
_JOINED = "pagedserve/joined"
_REASON = "pagedserve/reason/"  # + rank: why that worker stopped
_CANNOT_CONTINUE = "; this engine cannot run further steps (restart it)"
