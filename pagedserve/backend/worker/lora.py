"""Multi-LoRA on the model: the decoder's projections wrapped to add each row's adapter delta, the adapters'
stacked weights in `max_loras` resident slots swapped in LRU order, and the host copies kept for reloads.

Under tensor parallelism each rank holds its shard of every adapter (sharding.shard_lora_pair), a row-parallel
projection's LoRA inside its all-reduce. Rank 0 decides (slots, LRU) and sends its decisions in each step's plan
(`plan`); the workers `mirror` them, each reading the adapter folders itself."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.backend.core.config import LoRAConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.scheduler import ScheduledRequest
from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.lora import (
    LORA_PROJECTIONS,
    LoRAAdapter,
    LoRAAdapterError,
    load_lora_adapter,
    module_shapes,
)
from pagedserve.backend.model.parallel_layers import RowParallelLinear
from pagedserve.backend.model.sharding import shard_lora_pair
from pagedserve.backend.worker.parallel import LoRAPlan
from pagedserve.kernels.lora import SlotGroups, group_slots, native_projection

logger = logging.getLogger(__name__)


class LoRAStep:
    """What every wrapped projection reads during one forward: each token row's slot, or None when no row has
    an adapter (then the wrappers do no LoRA work at all), the rows grouped by slot once for all calls, and the
    slots the step uses."""

    __slots__ = ("slots", "groups", "active")

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None  # [T] int32, -1 = base model
        self.groups: SlotGroups | None = None
        self.active = 0  # bit s set: slot s has rows in this step

    def set(self, slots: torch.Tensor | None, active: int, device: torch.device) -> None:
        """The step's per-row slots (CPU int32; None: no row has an adapter), moved to `device` and grouped once."""
        self.active = active
        if slots is None:
            self.slots = self.groups = None
            return
        self.slots = slots.to(device, non_blocking=True)
        self.groups = group_slots(self.slots)


@dataclass(frozen=True, slots=True)
class LoRAShard:
    """Tensor parallelism's view of the adapters: each is checked against the whole model's `arch` and kept as
    rank `rank`'s part of it."""

    arch: ModelArchConfig
    rank: int
    world_size: int


class LoRALinear(nn.Module):
    """base(x), plus for the rows with an adapter x @ A.T @ B.T into each part's column slice (the fused q|k|v or
    gate|up projections have one A/B pair per part; A's of all parts stacked so one shrink serves them). A part
    no adapter of the step targets is skipped, and the whole projection when none targets any part."""

    def __init__(self, base: nn.Module, step: LoRAStep, lora_a: torch.Tensor, lora_b: list[torch.Tensor],
                 rank: int):
        super().__init__()
        self.base = base
        self.step = step
        self.rank = rank
        self.register_buffer("lora_a", lora_a, persistent=False)  # [S, parts * R, K]
        self.lora_b = lora_b  # per part: [S, N_part, R]
        self.offsets = [sum(b.shape[1] for b in lora_b[:i]) for i in range(len(lora_b))]
        self.targeted = [0] * len(lora_b)  # per part, bit s set: slot s's adapter adapts the part
        self.native = native_projection(lora_a, lora_b, self.offsets)  # the CPU's one-call path, where it serves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As the base projection, plus each row's adapter delta."""
        out = self.base(x)
        slots = self.step.slots
        if slots is None:
            return out
        active = self.step.active
        parts = [i for i, targeted in enumerate(self.targeted) if targeted & active]
        if not parts:
            return out
        # The CPU's one native pass serves every part at once (an untargeted part's B is zeros).
        if self.native is not None and self.native(out, x, slots):
            return out
        if len(parts) == len(self.lora_b):
            kernels.lora_shrink_expand_add(out, x, self.lora_a, self.lora_b, slots, self.offsets, self.step.groups)
            return out
        groups = self.step.groups
        y = kernels.lora_shrink(x, self.lora_a, slots, groups)  # [T, parts * R]
        rank = self.rank
        for i in parts:
            kernels.lora_expand_add(out, y[:, i * rank : (i + 1) * rank], self.lora_b[i], slots, self.offsets[i],
                                    groups)
        return out


class LoRAManager:
    """Owns the resident slots and the host copies. Adapters are known by the engine's load id (> 0); `prepare`
    gives the step's adapters slots (loading those not resident into the least recently used free ones) and
    sets the per-row slot tensor the wrappers read. `arch` is this rank's (its sizes are the projections');
    `shard` is given under tensor parallelism."""

    def __init__(self, model: nn.Module, arch: ModelArchConfig, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device, shard: LoRAShard | None = None):
        self.arch, self.config, self.dtype, self.device, self.shard = arch, config, dtype, device, shard
        self.step = LoRAStep()
        self.wrapped: dict[tuple[int, str], LoRALinear] = _wrap_projections(model, arch, config, self.step,
                                                                           dtype, device)
        self.paths: dict[int, tuple[str, str]] = {}  # load id -> (name, path)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_ids = [0] * config.max_loras  # load id per slot, 0 = empty; updated in place (the scheduler reads it)
        self._last_used = [0] * config.max_loras
        self._clock = 0
        self.num_loads = 0
        # Rank 0's loads and removals since its last plan (kept only under tensor parallelism, which sends them).
        self._loads: list[tuple[int, int, str, str]] = []
        self._removed: list[int] = []

    def add(self, lora_id: int, name: str, path: str) -> LoRAAdapter:
        """Read and check the adapter, keep it in host memory; InvalidRequestError (field "lora") if bad."""
        adapter = self._read(name, path)
        parts = {(layer, part) for (layer, projection) in self.wrapped for part in LORA_PROJECTIONS[projection]}
        missing = sorted(key for key in adapter.weights if key not in parts)
        if missing:
            layer, part = missing[0]
            raise InvalidRequestError(
                f"LoRA adapter {name!r} ({path}): layers.{layer}.{part} is not a projection LoRA can adapt in "
                f"this model", "lora")
        self.paths[lora_id] = (name, path)
        self._keep(lora_id, adapter)
        return adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter: its host copy and its slot."""
        self._forget(lora_id)
        if self.shard is not None:
            self._removed.append(lora_id)

    def plan(self) -> LoRAPlan:
        """Rank 0: what the workers need to mirror this step's LoRA state, the loads and removals since the last
        plan included."""
        slots = None if self.step.slots is None else self.step.slots.cpu()
        plan = LoRAPlan(self._loads, self._removed, slots, self.step.active)
        self._loads, self._removed = [], []
        return plan

    def mirror(self, plan: LoRAPlan) -> None:
        """A worker: make rank 0's removals and loads (reading each adapter folder not in host memory, at the
        same path), then take the step's slots; InvalidRequestError if a folder cannot be read here."""
        for lora_id in plan.removed:
            self._forget(lora_id)
        for slot, lora_id, name, path in plan.loads:
            self.paths[lora_id] = (name, path)
            self._copy_in(lora_id, slot)
        self.step.set(plan.slots, plan.active, self.device)

    def _forget(self, lora_id: int) -> None:
        self.paths.pop(lora_id, None)
        self.host.pop(lora_id, None)
        for slot, held in enumerate(self.slot_ids):
            if held == lora_id:
                self.slot_ids[slot] = 0

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> Sequence[ScheduledRequest]:
        """The step's requests ordered by adapter (base first, stable), whose rows the runner lays out in that
        order, num_scheduled_tokens each; sets their per-row slots, None when no request has an adapter."""
        if not any(item.request.sampling_params.lora_int_id for item in scheduled):
            self.step.set(None, 0, self.device)
            return scheduled
        scheduled = sorted(scheduled, key=lambda item: item.request.sampling_params.lora_int_id)
        ids = [item.request.sampling_params.lora_int_id for item in scheduled]
        slot_of = self._activate({i for i in ids if i})
        per_item = torch.tensor([slot_of.get(i, -1) for i in ids], dtype=torch.int32)
        counts = torch.tensor([item.num_scheduled_tokens for item in scheduled], dtype=torch.int64)
        rows = torch.repeat_interleave(per_item, counts, output_size=int(counts.sum()))
        self.step.set(rows, sum(1 << slot for slot in slot_of.values()), self.device)
        return scheduled

    def _activate(self, lora_ids: set[int]) -> dict[int, int]:
        """A slot for each of the step's adapters (at most max_loras): resident ones stay, others are loaded
        into empty slots, then into the least recently used slots no adapter of this step holds."""
        if len(lora_ids) > len(self.slot_ids):
            raise ValueError(f"{len(lora_ids)} adapters in one step, more than max_loras ({len(self.slot_ids)})")
        self._clock += 1
        slot_of = {held: slot for slot, held in enumerate(self.slot_ids) if held in lora_ids}
        for lora_id in sorted(lora_ids - slot_of.keys()):
            taken = set(slot_of.values())
            slot = min((s for s in range(len(self.slot_ids)) if s not in taken),
                       key=lambda s: (self.slot_ids[s] != 0, self._last_used[s]))
            self._copy_in(lora_id, slot)
            if self.shard is not None:
                self._loads.append((slot, lora_id, *self.paths[lora_id]))
            slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._last_used[slot] = self._clock
        return slot_of

    def _copy_in(self, lora_id: int, slot: int) -> None:
        """Copy an adapter into a slot: its A rows and B columns up to its rank, zeros elsewhere."""
        adapter = self.host.get(lora_id)
        if adapter is None:  # evicted from host memory: read again
            name, path = self.paths[lora_id]
            adapter = self._read(name, path)
        self._keep(lora_id, adapter)
        rank, r_max = adapter.rank, self.config.max_lora_rank
        for (layer, projection), linear in self.wrapped.items():
            linear.lora_a[slot].zero_()
            for i, part in enumerate(LORA_PROJECTIONS[projection]):
                lora_b = linear.lora_b[i][slot]
                lora_b.zero_()
                pair = adapter.weights.get((layer, part))
                linear.targeted[i] = linear.targeted[i] & ~(1 << slot) | (pair is not None) << slot
                if pair is not None:
                    linear.lora_a[slot, i * r_max : i * r_max + rank].copy_(pair[0])
                    lora_b[:, :rank].copy_(pair[1])
        self.slot_ids[slot] = lora_id
        self.num_loads += 1
        logger.info("LoRA adapter %r loaded into slot %d", adapter.name, slot)

    def _read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter checked against the whole model; under tensor parallelism this rank's shard of it."""
        shard = self.shard
        try:
            adapter = load_lora_adapter(name, path, self.arch if shard is None else shard.arch,
                                        self.config.max_lora_rank)
        except LoRAAdapterError as error:
            raise InvalidRequestError(str(error), "lora") from None
        if shard is not None:
            adapter.weights = {(layer, part): shard_lora_pair(part, a, b, shard.arch, shard.rank, shard.world_size)
                               for (layer, part), (a, b) in adapter.weights.items()}
        return adapter

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Host copy as the most recently used; beyond max_cpu_loras the least recently used is dropped."""
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)


def _wrap_projections(model: nn.Module, arch: ModelArchConfig, config: LoRAConfig, step: LoRAStep,
                      dtype: torch.dtype, device: torch.device) -> dict[tuple[int, str], LoRALinear]:
    """Replace every decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj by a LoRALinear over it; a
    family without one of them (a mixture of experts' MLP) keeps its module, and adapters of it are refused. A
    row-parallel projection's wrapper keeps its all-reduce outermost. `arch` gives the (this rank's) sizes."""
    shapes = module_shapes(arch)
    slots, rank = config.max_loras, config.max_lora_rank
    wrapped = {}
    for layer_index, layer in enumerate(model.layers):
        for projection, parts in LORA_PROJECTIONS.items():
            parent = getattr(layer, "self_attn" if projection in ("qkv_proj", "o_proj") else "mlp", None)
            base = getattr(parent, projection, None)
            attribute = projection
            if isinstance(base, RowParallelLinear):  # LoRA inside it: its all-reduce sums base and delta at once
                parent, base, attribute = base, base.base, "base"
            in_features = shapes[parts[0]][0]
            if (getattr(base, "in_features", None), getattr(base, "out_features", None)) != (
                    in_features, sum(shapes[p][1] for p in parts)):
                continue
            lora_a = torch.zeros(slots, len(parts) * rank, in_features, dtype=dtype, device=device)
            lora_b = _stacked_b(slots, [shapes[p][1] for p in parts], rank, dtype, device)
            linear = LoRALinear(base, step, lora_a, lora_b, rank)
            setattr(parent, attribute, linear)
            wrapped[(layer_index, projection)] = linear
    return wrapped


def _stacked_b(slots: int, sizes: list[int], rank: int, dtype: torch.dtype,
               device: torch.device) -> list[torch.Tensor]:
    """Zeroed stacked B [S, N_p, R] of each part. On the CPU views of one [S, R, sum N_p] storage, the parts'
    columns side by side as in the projection's output: the native kernels read its n-contiguous rows without
    transposing them, and one call serves every part."""
    if torch.device(device).type == "cpu":
        storage = torch.zeros(slots, rank, sum(sizes), dtype=dtype, device=device)
        return [part.transpose(1, 2) for part in storage.split(sizes, dim=2)]
    return [torch.zeros(slots, n, rank, dtype=dtype, device=device) for n in sizes]
