"""`pagedserve serve`'s engine flags: one per engine parameter the llm model reads (core/parameters.py), its
type, choices and help from the config dataclasses, vLLM's spelling (`--max-num-seqs`); each flag given
becomes the llm model's config.pbtxt parameter of the same name, checked by the engine at load."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from pagedserve.backend.core.parameters import EngineParameter, triton_parameters

# Registered in serve's LoRA group (lora_options.py), whose lora_parameters writes them only with LoRA on.
LORA_PARAMETERS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
_METAVARS = {int: "N", float: "X", dict: "JSON"}


def _parameters(names: Iterable[str] | None) -> list[EngineParameter]:
    """The named parameters, in the list's order; None: every one outside the LoRA group."""
    if names is None:
        return [parameter for parameter in triton_parameters() if parameter.name not in LORA_PARAMETERS]
    wanted = set(names)
    return [parameter for parameter in triton_parameters() if parameter.name in wanted]


def _help(parameter: EngineParameter) -> str:
    """The parameter's help with its default, escaped for argparse's %-formatting."""
    text = parameter.help.replace("%", "%%")
    if parameter.default is None or parameter.type is bool:
        return text  # BooleanOptionalAction names the --no- form; None defaults are described in the help
    return f"{text} (default: {parameter.default})"


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         names: Iterable[str] | None = None) -> None:
    """Register the flags of the named engine parameters (None: all but the LoRA group's). Every default is
    None, so a flag not given leaves config.pbtxt's value as it is."""
    for parameter in _parameters(names):
        if parameter.type is bool:
            parser.add_argument(parameter.flag, action=argparse.BooleanOptionalAction, default=None,
                                help=_help(parameter))
            continue
        value_type = str if parameter.type is dict else parameter.type  # JSON text, checked by the engine
        parser.add_argument(parameter.flag, type=value_type, default=None, choices=parameter.choices,
                            metavar=None if parameter.choices else _METAVARS.get(parameter.type),
                            help=_help(parameter))


def config_value(value: object) -> str:
    """A flag's value as a config.pbtxt string_value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def engine_flag_parameters(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, str]:
    """The llm model's config.pbtxt parameters of the named engine flags that were given (None: all but the
    LoRA group's)."""
    given = {parameter.name: getattr(args, parameter.name, None) for parameter in _parameters(names)}
    return {name: config_value(value) for name, value in given.items() if value is not None}
