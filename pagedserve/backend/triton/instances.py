"""Where one instance of the llm model runs, and its share of what it shares with the model's other instances.

Triton's `instance_group` starts `count` instances (one stub process each, so one engine each) and tells
each its kind and device. The instances on one device split its KV budget and, on the CPU, its cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedserve.backend.worker.model_runner import CPU_KV_CACHE_BYTES

_SHARED_KV_KEYS = ("num_blocks", "kv_cache_memory_bytes")


@dataclass(frozen=True)
class Instance:
    """One llm model instance as Triton describes it in initialize()'s `args` and the model config."""

    name: str  # Triton's model_instance_name (llm_0_1): the metrics' `instance` label
    kind: str  # "CPU", "GPU" or "MODEL"
    device_id: int  # the GPU of a KIND_GPU instance
    peers: int  # instances of this model on the same device, this one included

    @classmethod
    def from_args(cls, args: dict[str, str], config: dict[str, Any]) -> Instance:
        """The instance of `args`, its peers counted from the config's (normalized) instance_group."""
        kind, device_id = args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", "0"))
        groups = config.get("instance_group") or [{"kind": "KIND_CPU", "count": 1}]
        if kind == "GPU":
            peers = sum(int(g.get("count", 1)) for g in groups if g.get("kind") == "KIND_GPU"
                        and device_id in [int(gpu) for gpu in g.get("gpus", [])])
        else:
            peers = sum(int(g.get("count", 1)) for g in groups if g.get("kind") != "KIND_GPU")
        return cls(args.get("model_instance_name", args.get("model_name", "llm")), kind, device_id, max(peers, 1))


def instance_device(instance: Instance, configured: str, cuda_available: bool) -> str:
    """The torch device the instance's engine runs on: its own GPU for KIND_GPU, else the configured one
    ("auto" resolved: CUDA when present, as a single instance always did)."""
    if instance.kind != "GPU":
        if configured == "auto":
            return "cuda" if cuda_available else "cpu"
        return configured
    own = f"cuda:{instance.device_id}"
    if configured not in ("auto", "cuda", own):
        raise ValueError(f"instance {instance.name} is KIND_GPU on GPU {instance.device_id}, but config.pbtxt "
                         f"parameter device is {configured!r}: leave it 'auto' (or {own!r})")
    if not cuda_available:
        raise ValueError(f"instance {instance.name} is KIND_GPU on GPU {instance.device_id}, but torch sees no CUDA")
    return own


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    return len(os.sched_getaffinity(0))


def instance_engine_kwargs(kwargs: dict[str, Any], instance: Instance, device: str, cores: int) -> dict[str, Any]:
    """The engine kwargs of one of `instance.peers` instances on `device`: an equal share of the KV budget
    (num_blocks, kv_cache_memory_bytes, or on the CPU the default budget) and of the CPU threads."""
    share = {**kwargs, "device": device}
    peers = instance.peers
    if peers == 1:
        return share
    if device == "cpu":
        share["cpu_threads"] = max(1, (kwargs.get("cpu_threads") or cores) // peers)
    given = [key for key in _SHARED_KV_KEYS if kwargs.get(key) is not None]
    if not given and device != "cpu":
        # The CUDA budget is a fraction of the device less what other processes hold: the second instance to
        # load would see the first's cache as taken and get nothing. An explicit size splits cleanly.
        raise ValueError(f"{peers} instances of the llm model share {device}: set config.pbtxt parameter "
                         "num_blocks or kv_cache_memory_bytes (each instance gets an equal share)")
    budgets = {key: kwargs[key] for key in given} or {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    for key, total in budgets.items():
        if total // peers < 1:
            raise ValueError(f"config.pbtxt parameter {key} = {total} cannot be shared by {peers} instances")
        share[key] = total // peers
    return share
