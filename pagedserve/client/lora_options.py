"""`pagedserve serve`'s LoRA flags, vLLM's names where it has them: the adapters (`--lora NAME=PATH`, written as
the llm model's multi_lora.json), the engine's limits (config.pbtxt parameters) and the OpenAI shim's flags."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NamedTuple

from pagedserve.backend.model.default_model import MODEL_NAME as DEFAULT_MODEL_NAME
from pagedserve.client.engine_flags import LORA_PARAMETERS, add_engine_arguments

# An adapter name is a model name of the OpenAI API: no whitespace, no quote that would break a config.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]*")
# The keys of vLLM's JSON form of a --lora-modules item.
JSON_FIELDS = ("name", "path", "base_model_name")


class LoRAModule(NamedTuple):
    """One adapter of `--lora`: its name, absolute folder and the base model it names (vLLM's JSON form)."""

    name: str
    path: str
    base_model_name: str | None = None


def adapter_module(item: str) -> LoRAModule:
    """One `--lora NAME=PATH`, or vLLM's JSON `{"name", "path", "base_model_name"}`, as a LoRAModule with the
    folder made absolute; argparse reports a failure as `argument --lora/--lora-modules: ...`."""
    if item.lstrip().startswith("{"):
        name, path, base = _json_module(item)
    else:
        name, sep, path = item.partition("=")
        name, path, base = name.strip(), path.strip(), None
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {item!r}")
    if not ADAPTER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"adapter name {name!r} must start with a letter or digit and hold no "
                                         "spaces or quotes")
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of adapter {name!r} does not exist: {folder}")
    return LoRAModule(name, str(folder), base)


def _json_module(item: str) -> tuple[str, str, str | None]:
    """vLLM's JSON form of one --lora-modules item: (name, path, base_model_name or None)."""
    try:
        entry = json.loads(item)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"invalid JSON for --lora-modules ({error}): {item}") from None
    if not isinstance(entry, dict):
        raise argparse.ArgumentTypeError(f"a JSON --lora-modules item must be an object, got {item}")
    unknown = sorted(set(entry) - set(JSON_FIELDS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown --lora-modules field {unknown[0]!r} in {item}; allowed: "
                                         f"{', '.join(JSON_FIELDS)}")
    for field in ("name", "path"):
        if not isinstance(entry.get(field), str) or not entry[field].strip():
            raise argparse.ArgumentTypeError(f"a JSON --lora-modules item needs {field!r} (a non-empty string), "
                                             f"got {item}")
    base = entry.get("base_model_name")
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise argparse.ArgumentTypeError(f"--lora-modules base_model_name must be a non-empty string, got {item}")
    return entry["name"].strip(), entry["path"].strip(), base.strip() if base else None


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the LoRA options of `serve`."""
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--lora", "--lora-modules", action="extend", nargs="+", type=adapter_module, default=[],
                       metavar="NAME=PATH", help="serve the PEFT adapter in folder PATH as model NAME (repeatable, "
                       "or several after one flag as vLLM's --lora-modules; turns LoRA on); or vLLM's JSON form "
                       "'{\"name\": NAME, \"path\": PATH, \"base_model_name\": BASE}'")
    add_engine_arguments(group, LORA_PARAMETERS)  # --enable-lora (even with no --lora), --max-loras, ...
    group.add_argument("--enable-lora-runtime-updates", action="store_true",
                       help="load and unload adapters at run time (the shim's /v1/load_lora_adapter and "
                            "/v1/unload_lora_adapter, the llm model's lora_control; vLLM's "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    group.add_argument("--lora-separator", default=None, metavar="SEP",
                       help="the shim also answers to MODEL<SEP>ADAPTER names (Triton's OpenAI frontend)")


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """The --lora adapters by name; a name given twice, or a base_model_name that is not the served model, is
    refused."""
    modules: dict[str, str] = {}
    for name, folder, base in args.lora:
        if name in modules:
            raise SystemExit(f"--lora {name}: the name is given twice")
        if base is not None:
            _check_base_model(name, base, getattr(args, "model", None))
        modules[name] = folder
    return modules


def _check_base_model(adapter: str, base: str, model: str | None) -> None:
    """A JSON --lora-modules base_model_name must name the one model served: the id /v1/models lists for it
    (the folder's name, as the shim names it) or --model as written. Every adapter's `parent` is that id."""
    served = Path(model).expanduser().resolve().name if model else DEFAULT_MODEL_NAME
    if base not in (served, model):
        written = f" or {model!r}" if model and model != served else ""
        raise SystemExit(f"--lora-modules {adapter}: base_model_name {base!r} is not the served base model "
                         f"({served!r}{written})")


def lora_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The llm model's config.pbtxt LoRA parameters of the flags given (none without LoRA)."""
    enabled = bool(args.lora) or args.enable_lora or args.enable_lora_runtime_updates
    limits = {"max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras}
    if not enabled:
        given = [name for name, value in limits.items() if value is not None]
        if given:
            raise SystemExit(f"--{given[0].replace('_', '-')} needs LoRA on: give --lora NAME=PATH or --enable-lora")
        return {}
    params = {"enable_lora": "true", **{name: str(value) for name, value in limits.items() if value is not None}}
    if args.enable_lora_runtime_updates:
        params["enable_lora_runtime_updates"] = "true"
    return params


def lora_shim_flags(args: argparse.Namespace) -> list[str]:
    """The shim's LoRA flags as `serve` was given them."""
    flags = ["--enable-lora-runtime-updates"] if args.enable_lora_runtime_updates else []
    if args.lora_separator:
        flags += ["--lora-separator", args.lora_separator]
    return flags
