"""The engine's parameters, listed from the config dataclasses (core/config.py): from_pretrained's options
(engine/engine_args.py), the llm model's config.pbtxt parameters (triton/settings.py) and `pagedserve serve`'s
flags (client/engine_flags.py) are derived from this list; config.pbtxt and the README are checked against it
(tests/core/test_parameters.py)."""

from __future__ import annotations

import functools
import typing
from dataclasses import MISSING, dataclass, fields

from pagedserve.backend.core.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# The configs whose fields are engine parameters, one each (SpeculativeConfig is one JSON parameter).
ENGINE_CONFIGS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig)
VALUE_TYPES = (int, float, bool, str, dict)  # dict: a JSON object


@dataclass(frozen=True)
class EngineParameter:
    """One engine parameter: an option of LLMEngine.from_pretrained, the llm model's config.pbtxt parameter of
    the same name (when `triton`) and serve's flag `--name-with-dashes`."""

    name: str
    config: type | None  # the config it sets: a field of it, or (not is_field) the whole config
    type: type  # one of VALUE_TYPES
    default: object  # the config's default; None: decided at load (from the model, the memory budget) or off
    help: str
    choices: tuple[str, ...] | None = None
    is_field: bool = True  # False: an option the engine turns into its config (or its adapters) itself
    triton: bool = True  # False: not a config.pbtxt parameter (lora_modules come from the llm model's multi_lora.json)

    @property
    def flag(self) -> str:
        """serve's flag for it, vLLM's spelling."""
        return "--" + self.name.replace("_", "-")


# The options that are not a config's field, as the engine takes them.
SPECULATIVE_CONFIG = EngineParameter(
    "speculative_config", SpeculativeConfig, dict, None,
    'speculative decoding as JSON, vLLM\'s names: {"method": "ngram", "num_speculative_tokens": 3}',
    is_field=False)
LORA_MODULES = EngineParameter(
    "lora_modules", None, dict, None, "LoRA adapters to serve from the start: name -> adapter folder",
    is_field=False, triton=False)


def _value_type(hint: object, where: str) -> type:
    """The value type of an annotation such as `int | None`; TypeError for one no parameter can carry."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    value_type = args[0] if len(args) == 1 else hint
    if value_type not in VALUE_TYPES:
        raise TypeError(f"{where}: an engine parameter's type must be one of {VALUE_TYPES}, got {hint!r}")
    return value_type


def config_parameters(config: type) -> list[EngineParameter]:
    """The parameters of one config: each field with a default (a field without one, ModelConfig.model, is
    from_pretrained's first argument); TypeError for a field not made with `param`."""
    hints = typing.get_type_hints(config)
    found = []
    for item in fields(config):
        if item.default is MISSING and item.default_factory is MISSING:
            continue
        where = f"{config.__name__}.{item.name}"
        if "help" not in item.metadata:
            raise TypeError(f"{where}: make an engine parameter with core.config.param(default, help)")
        found.append(EngineParameter(item.name, config, _value_type(hints[item.name], where), item.default,
                                     item.metadata["help"], item.metadata["choices"]))
    return found


@functools.cache
def engine_parameters() -> tuple[EngineParameter, ...]:
    """Every engine parameter: the ENGINE_CONFIGS' fields in order, then speculative_config and lora_modules."""
    listed = [parameter for config in ENGINE_CONFIGS for parameter in config_parameters(config)]
    listed += [SPECULATIVE_CONFIG, LORA_MODULES]
    names = [parameter.name for parameter in listed]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise TypeError(f"engine parameters named twice across the configs: {duplicates}")
    return tuple(listed)


def triton_parameters() -> tuple[EngineParameter, ...]:
    """The engine parameters the llm model reads from its config.pbtxt `parameters`."""
    return tuple(parameter for parameter in engine_parameters() if parameter.triton)
