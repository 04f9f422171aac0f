"""LLMEngine.from_pretrained's keyword options: checked by name and split into the engine's configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.model import ModelArchConfig

CONFIG_FIELDS: dict[type, tuple[str, ...]] = {
    ModelConfig: ("dtype", "quantization", "device", "seed", "cpu_threads", "tensor_parallel_size"),
    CacheConfig: (
        "block_size",
        "num_blocks",
        "kv_cache_memory_bytes",
        "gpu_memory_utilization",
        "enable_prefix_caching",
    ),
    SchedulerConfig: (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "max_num_waiting",
        "scheduling_policy",
    ),
    LoRAConfig: ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"),
}
# Options that are not a config's field: speculative_config (dict or JSON), lora_modules (name -> folder).
OTHER_OPTIONS = ("speculative_config", "lora_modules")


@dataclass(slots=True)
class EngineArgs:
    """Everything LLMEngine's constructor takes."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: SpeculativeConfig | None
    lora_config: LoRAConfig
    lora_modules: dict[str, str] | None


def engine_args(model: str, options: dict[str, Any]) -> EngineArgs:
    """The configs for `model` from from_pretrained's options; an unknown option is refused naming it.
    max_model_len defaults to the model's max_position_embeddings."""
    options = dict(options)
    known = {name for names in CONFIG_FIELDS.values() for name in names} | set(OTHER_OPTIONS)
    for key in options:
        if key not in known:
            raise InvalidRequestError(f"unknown engine option {key!r}; allowed: {', '.join(sorted(known))}", key)
    speculative_config = SpeculativeConfig.from_value(options.pop("speculative_config", None))
    lora_modules = options.pop("lora_modules", None)
    if "max_model_len" not in options:
        options["max_model_len"] = ModelArchConfig.from_pretrained(model).max_position_embeddings
    configs = {
        cls: cls(**{k: v for k, v in options.items() if k in names})
        for cls, names in CONFIG_FIELDS.items()
        if cls is not ModelConfig
    }
    model_config = ModelConfig(model=str(model), **{k: v for k, v in options.items() if k in CONFIG_FIELDS[ModelConfig]})
    return EngineArgs(model_config, configs[CacheConfig], configs[SchedulerConfig], speculative_config,
                      configs[LoRAConfig], lora_modules)
