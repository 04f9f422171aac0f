"""One source for the engine's parameters: the config dataclasses (core/config.py), listed by
core/parameters.engine_parameters. Each place a parameter must appear, and what keeps it there:

- LLMEngine.from_pretrained's options (engine/engine_args.py CONFIG_FIELDS, OTHER_OPTIONS): derived from the list;
  test_from_pretrained_takes_every_parameter_into_its_config checks each reaches its config.
- the llm model's config.pbtxt parsing (triton/settings.py engine_arguments): derived from the list, read when
  it runs.
- `pagedserve serve`'s flags (client/engine_flags.py, in serve's parser through launcher.add_arguments and
  lora_options.add_lora_arguments): derived from the list, read when the parser is built;
  test_serve_has_a_flag_for_every_engine_parameter checks the parser serve really builds.
- pagedserve/model_repository/llm/config.pbtxt (each parameter, its default or "") and the README's table (each
  parameter with its flag and default): written by hand, checked here.

test_a_field_added_to_a_config_reaches_the_derived_places_and_fails_the_hand_written_checks adds a field to a
config and shows both: the flag and the Triton parsing take it, the config.pbtxt and README checks fail for it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import pytest

from pagedserve.backend.core import parameters
from pagedserve.backend.core.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    param,
)
from pagedserve.backend.core.errors import (
    ConfigError,
    ErrorKind,
    InvalidRequestError,
    error_kind,
    from_wire,
    to_wire,
)
from pagedserve.backend.core.parameters import (
    ENGINE_CONFIGS,
    config_parameters,
    engine_parameters,
    triton_parameters,
)
from pagedserve.backend.triton.settings import engine_arguments
from pagedserve.client.engine_flags import add_engine_arguments, engine_flag_parameters

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PBTXT = ROOT / "pagedserve" / "model_repository" / "llm" / "config.pbtxt"
README = ROOT / "README.md"
PBTXT_PARAMETER = re.compile(r'^parameters \{ key: "(?P<key>[^"]+)" value: \{ string_value: "(?P<value>[^"]*)" \} \}',
                             re.MULTILINE)
# A value of each type every parameter's flag accepts, and the engine's check after it.
SAMPLES = {int: ("7", 7), float: ("0.5", 0.5), dict: ('{"num_speculative_tokens": 2}', '{"num_speculative_tokens": 2}')}


def _text(default: object) -> str:
    """A default as config.pbtxt and the README write it."""
    return ("true" if default else "false") if isinstance(default, bool) else str(default)


def pbtxt_problems(text: str, listed: tuple) -> list[str]:
    """What config.pbtxt lacks: a parameter missing, or set to neither its default nor "" (the default)."""
    values = {match["key"]: match["value"] for match in PBTXT_PARAMETER.finditer(text)}
    problems = []
    for parameter in listed:
        if parameter.name not in values:
            problems.append(f"{parameter.name}: missing")
        elif values[parameter.name] not in ("", _text(parameter.default) if parameter.default is not None else ""):
            problems.append(f"{parameter.name}: {values[parameter.name]!r} is not {_text(parameter.default)!r}")
    return problems


def readme_rows(text: str) -> dict[str, list[str]]:
    """The Configuration table's rows by parameter name: [first cell, default, meaning]."""
    section = text.split("## Configuration", 1)[1]
    table = section[section.index("| parameter"):].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows[re.match(r"`([a-z_]+)`", cells[0]).group(1)] = cells
    return rows


def readme_problems(text: str, listed: tuple) -> list[str]:
    """What the README's table lacks: a parameter's row, its serve flag in it, or its default (when it has one)."""
    rows = readme_rows(text)
    problems = []
    for parameter in listed:
        row = rows.get(parameter.name)
        if row is None:
            problems.append(f"{parameter.name}: no row")
            continue
        if f"`{parameter.flag}`" not in row[0]:
            problems.append(f"{parameter.name}: its flag {parameter.flag} is not in its row")
        if parameter.default is not None and row[1].strip("`") != _text(parameter.default):
            problems.append(f"{parameter.name}: default {row[1]!r} is not {_text(parameter.default)!r}")
    return problems


def test_every_field_of_the_engine_configs_is_a_parameter_with_its_type_default_and_help():
    listed = {parameter.name: parameter for parameter in engine_parameters()}
    for config in ENGINE_CONFIGS:
        for item in fields(config):
            if item.name == "model":
                assert item.default is MISSING and "model" not in listed  # from_pretrained's first argument
                continue
            parameter = listed[item.name]
            assert (parameter.config, parameter.default, parameter.is_field) == (config, item.default, True)
            assert parameter.help and parameter.type in (int, float, bool, str, dict)
    assert listed["cpu_threads"].type is int and listed["gpu_memory_utilization"].type is float
    assert listed["enable_prefix_caching"].type is bool and listed["quantization"].choices == ("none", "int8", "int4")
    assert listed["scheduling_policy"].choices == ("fcfs", "priority") and listed["device"].choices is None


def test_the_options_that_are_not_fields_are_speculative_config_and_lora_modules():
    others = [parameter for parameter in engine_parameters() if not parameter.is_field]
    assert [(p.name, p.config, p.type, p.triton) for p in others] == [
        ("speculative_config", SpeculativeConfig, dict, True), ("lora_modules", None, dict, False)]
    assert [p.name for p in triton_parameters()] == [p.name for p in engine_parameters()][:-1]


def test_a_config_field_made_without_param_or_of_a_type_no_flag_carries_is_refused():
    @dataclass(slots=True)
    class Plain:
        block_size: int = 16

    @dataclass(slots=True)
    class Listy:
        sizes: list = param((1, 2), "a list")

    with pytest.raises(TypeError, match=r"Plain.block_size: make an engine parameter with core.config.param"):
        config_parameters(Plain)
    with pytest.raises(TypeError, match="Listy.sizes"):
        config_parameters(Listy)


def test_config_pbtxt_sets_every_engine_parameter_to_its_default_or_empty():
    assert pbtxt_problems(CONFIG_PBTXT.read_text(), triton_parameters()) == []


def test_the_readme_table_names_every_parameter_with_its_flag_and_default():
    assert readme_problems(README.read_text(), triton_parameters()) == []
    assert "--lora-modules" in README.read_text()  # lora_modules: serve's adapters, not a config.pbtxt parameter


def test_serve_has_a_flag_for_every_engine_parameter():
    from pagedserve.client import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    for parameter in engine_parameters():
        action = actions[parameter.flag]
        if parameter.name == "lora_modules":
            continue  # --lora NAME=PATH / --lora-modules: adapters checked as folders (lora_options.py)
        assert action.default is None, parameter.name  # config.pbtxt's value stays unless the flag is given
        assert action.choices == parameter.choices, parameter.name
        if parameter.type is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), parameter.name
        else:
            assert action.type is (str if parameter.type is dict else parameter.type), parameter.name


def _sample_argv(listed: tuple) -> tuple[list[str], dict]:
    """serve flags giving every listed parameter a value other than its default, and the engine's kwargs."""
    argv, want = [], {}
    for parameter in listed:
        if parameter.type is bool:
            argv.append(f"--no-{parameter.flag[2:]}" if parameter.default else parameter.flag)
            want[parameter.name] = not parameter.default
            continue
        if parameter.choices:
            raw, value = parameter.choices[-1], parameter.choices[-1]
        else:
            raw, value = SAMPLES.get(parameter.type, ("cpu", "cpu"))
        argv += [parameter.flag, raw]
        want[parameter.name] = value
    return argv, want


def test_each_serve_flag_reaches_the_llm_model_as_its_typed_engine_option():
    listed = triton_parameters()
    names = [parameter.name for parameter in listed]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, names)
    argv, want = _sample_argv(listed)
    given = engine_flag_parameters(parser.parse_args(argv), names)
    model, kwargs = engine_arguments({key: {"string_value": value} for key, value in given.items()})
    assert (model, kwargs) == ("", want)
    assert engine_flag_parameters(parser.parse_args([]), names) == {}


def test_from_pretrained_takes_every_parameter_into_its_config():
    from pagedserve.backend.engine.engine_args import CONFIG_FIELDS, OTHER_OPTIONS, engine_args

    assert OTHER_OPTIONS == ("speculative_config", "lora_modules")
    assert {name for names in CONFIG_FIELDS.values() for name in names} == {
        p.name for p in engine_parameters() if p.is_field}
    options = {"dtype": "float32", "quantization": "int8", "device": "cpu", "seed": 3, "cpu_threads": 2,
               "tensor_parallel_size": 2, "runner": "pooling", "max_pooling_inputs": 7, "block_size": 32, "num_blocks": 9, "kv_cache_memory_bytes": 4096,
               "gpu_memory_utilization": 0.5, "enable_prefix_caching": False, "max_num_seqs": 4,
               "max_num_batched_tokens": 64, "max_model_len": 128, "max_num_waiting": 5,
               "scheduling_policy": "priority", "max_num_encoder_input_tokens": 16,
               "encoder_cache_size": 64, "limit_mm_per_prompt": {"image": 2}, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
               "max_cpu_loras": 3, "kv_events_config": {"enable_kv_cache_events": True},
               "data_parallel_rank": 1, "kv_cache_dtype": "fp8_e5m2",
               "calculate_kv_scales": True}
    assert set(options) == set(CONFIG_FIELDS[ModelConfig] + CONFIG_FIELDS[CacheConfig]
                               + CONFIG_FIELDS[SchedulerConfig] + CONFIG_FIELDS[LoRAConfig])
    args = engine_args("/m", {**options, "speculative_config": '{"num_speculative_tokens": 2}',
                              "lora_modules": {"a": "/adapters/a"}})
    configs = (args.model_config, args.cache_config, args.scheduler_config, args.lora_config)
    for parameter in engine_parameters():
        if parameter.is_field:
            config = next(config for config in configs if type(config) is parameter.config)
            assert getattr(config, parameter.name) == options[parameter.name], parameter.name
    assert args.speculative_config.num_speculative_tokens == 2 and args.lora_modules == {"a": "/adapters/a"}


@dataclass(slots=True)
class GrownCacheConfig(CacheConfig):
    """CacheConfig with one more field, as a future change would add it."""

    frobnicate_level: int = param(3, "a parameter added to a config")


def test_a_field_added_to_a_config_reaches_the_derived_places_and_fails_the_hand_written_checks(monkeypatch):
    grown = tuple(GrownCacheConfig if config is CacheConfig else config for config in ENGINE_CONFIGS)
    monkeypatch.setattr(parameters, "ENGINE_CONFIGS", grown)
    engine_parameters.cache_clear()
    try:
        listed = triton_parameters()
        assert "frobnicate_level" in [parameter.name for parameter in listed]
        parser = argparse.ArgumentParser()
        add_engine_arguments(parser)
        assert engine_flag_parameters(parser.parse_args(["--frobnicate-level", "5"])) == {"frobnicate_level": "5"}
        assert engine_arguments({"frobnicate_level": {"string_value": "5"}}) == ("", {"frobnicate_level": 5})
        assert pbtxt_problems(CONFIG_PBTXT.read_text(), listed) == ["frobnicate_level: missing"]
        assert readme_problems(README.read_text(), listed) == ["frobnicate_level: no row"]
    finally:
        engine_parameters.cache_clear()


def test_the_checks_see_a_wrong_default_and_a_row_without_its_flag():
    listed = triton_parameters()
    pbtxt = CONFIG_PBTXT.read_text().replace('key: "block_size" value: { string_value: "16" }',
                                             'key: "block_size" value: { string_value: "32" }')
    assert pbtxt_problems(pbtxt, listed) == ["block_size: '32' is not '16'"]
    readme = README.read_text().replace("| `seed` (`--seed`) | 0 |", "| `seed` | 1 |")
    assert readme_problems(readme, listed) == ["seed: its flag --seed is not in its row",
                                               "seed: default '1' is not '0'"]


@pytest.mark.parametrize(("make", "field"), [
    (lambda: CacheConfig(block_size=12), "block_size"),
    (lambda: SchedulerConfig(scheduling_policy="lifo"), "scheduling_policy"),
    (lambda: ModelConfig("m", quantization="fp8"), "quantization"),
    (lambda: LoRAConfig(max_loras=2, max_cpu_loras=1), "max_cpu_loras"),
    (lambda: SpeculativeConfig.from_value("{not json"), "speculative_config"),
    (lambda: SpeculativeConfig.from_value({"num_speculative_tokens": 0}), "speculative_config.num_speculative_tokens"),
    (lambda: engine_arguments({"max_num_seqs": {"string_value": "many"}}), "max_num_seqs"),
])
def test_a_bad_setting_is_a_config_error_naming_its_field_in_the_tag_and_the_words(make, field):
    with pytest.raises(ConfigError) as info:
        make()
    error = info.value
    assert isinstance(error, InvalidRequestError) and error.field == field and field in str(error)
    assert error_kind(error) is ErrorKind.INVALID_ARGUMENT
    wire = from_wire(to_wire(error))
    assert (wire.kind, wire.field) == (ErrorKind.INVALID_ARGUMENT, field)


def test_a_request_error_is_not_a_config_error():
    from pagedserve.backend.core.errors import json_object

    with pytest.raises(InvalidRequestError) as info:
        json_object("[1]", "sampling_parameters")
    assert not isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError):
        json_object("[1]", "speculative_config", ConfigError)
