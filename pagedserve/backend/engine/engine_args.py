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
from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.parameters import ENGINE_CONFIGS, engine_parameters
from pagedserve.backend.model import ModelArchConfig

# Each config's options, and the options that are not a config's field (speculative_config: dict or JSON,
# lora_modules: name -> folder), both from the engine's parameter list (core/parameters.py).
CONFIG_FIELDS: dict[type, tuple[str, ...]] = {
    config: tuple(p.name for p in engine_parameters() if p.config is config and p.is_field) for config in ENGINE_CONFIGS
}
OTHER_OPTIONS = tuple(p.name for p in engine_parameters() if not p.is_field)


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
            raise ConfigError(f"unknown engine option {key!r}; allowed: {', '.join(sorted(known))}", key)
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
