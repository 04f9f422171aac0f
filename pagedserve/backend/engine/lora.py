"""The engine's LoRA adapters by name: load ids, which requests may name them, the scheduler's LoRA
arguments; LLMEngine holds one `LoRARegistry` and its add_lora / remove_lora / list_loras call it."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from pagedserve.backend.core.config import LoRAConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler
from pagedserve.backend.worker.lora import LoRAManager


def scheduler_lora_args(config: LoRAConfig | None, manager: LoRAManager | None) -> dict[str, Any]:
    """The Scheduler's LoRA arguments: the slots' count and the resident load ids (none when LoRA is off)."""
    if manager is None:
        return {}
    return {"max_loras": (config if config is not None else LoRAConfig()).max_loras,
            "resident_loras": manager.slot_ids}


class LoRARegistry:
    """Adapters by name, in load order. Each load gets a new id (never reused), which requests carry as
    `SamplingParams.lora_int_id` into the scheduler, the block hashes and the runner's slots."""

    def __init__(self, config: LoRAConfig | None, manager: LoRAManager | None) -> None:
        self.config = config if config is not None else LoRAConfig()
        self.manager = manager
        self._by_name: dict[str, tuple[int, str]] = {}  # name -> (load id, path)
        self._names: dict[int, str] = {}  # load id -> name
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        """Whether this engine serves adapters at all."""
        return self.manager is not None

    def load_modules(self, lora_modules: Mapping[str, str] | None) -> None:
        """The adapters given at start-up (name -> folder), loaded as `add` loads them."""
        if not lora_modules:
            return
        if not isinstance(lora_modules, Mapping):
            raise InvalidRequestError(
                f"lora_modules must map adapter names to folders, got {type(lora_modules).__name__}", "lora_modules")
        for name, path in lora_modules.items():
            self.add(name, str(path))

    def add(self, name: str, path: str) -> None:
        """Load and check an adapter under `name`; InvalidRequestError naming it when it cannot serve."""
        if self.manager is None:
            raise InvalidRequestError(f"cannot load LoRA adapter {name!r}: LoRA is not enabled (enable_lora)",
                                      "enable_lora")
        if not isinstance(name, str) or not name or name != name.strip():
            raise InvalidRequestError(f"a LoRA adapter's name must be a non-empty string, got {name!r}", "lora")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError(f"LoRA adapter {name!r}: path must be a non-empty string, got {path!r}",
                                      "lora")
        if name in self._by_name:
            raise InvalidRequestError(f"LoRA adapter {name!r} is already loaded (from {self._by_name[name][1]})",
                                      "lora")
        lora_id = next(self._ids)
        self.manager.add(lora_id, name, path)
        self._by_name[name] = (lora_id, path)
        self._names[lora_id] = name

    def remove(self, name: str, live: Iterable[Request]) -> None:
        """Forget an adapter no live request uses; InvalidRequestError naming it otherwise."""
        entry = self._by_name.get(name)
        if entry is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}", "lora")
        lora_id = entry[0]
        users = sum(1 for r in live if r.sampling_params.lora_int_id == lora_id)
        if users:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} is in use by {users} request sequences; unload it once they finish",
                "lora")
        del self._by_name[name]
        del self._names[lora_id]
        self.manager.remove(lora_id)

    def list(self) -> dict[str, str]:
        """Name -> path, in load order."""
        return {name: path for name, (_, path) in self._by_name.items()}

    def resolve(self, params: SamplingParams) -> None:
        """Fill in `params.lora_int_id` from its lora_name; an unknown name, or any with LoRA off, is refused."""
        name = params.lora_name
        if name is None:
            params.lora_int_id = 0
            return
        if self.manager is None:
            raise InvalidRequestError(f"lora_name {name!r} given, but LoRA is not enabled on this model",
                                      "lora_name")
        entry = self._by_name.get(name)
        if entry is None:
            loaded = ", ".join(self._by_name) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {name!r} (lora_name); loaded: {loaded}",
                                      "lora_name")
        params.lora_int_id = entry[0]

    def stats(self, scheduler: Scheduler) -> dict[str, Any]:
        """EngineStats' LoRA fields: the adapters of running and waiting requests, max_loras (0: LoRA off)."""
        if self.manager is None:
            return {}
        running = {r.sampling_params.lora_int_id for r in scheduler.running if not r.is_finished}
        waiting = {r.sampling_params.lora_int_id for r in scheduler.waiting if not r.is_finished}
        return {
            "running_lora_adapters": sorted(self._names[i] for i in running if i in self._names),
            "waiting_lora_adapters": sorted(self._names[i] for i in waiting if i in self._names),
            "max_lora": self.config.max_loras,
        }
