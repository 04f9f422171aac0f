"""`pagedserve serve`'s LoRA flags, vLLM's names where it has them: the adapters (`--lora NAME=PATH`, written as
the llm model's multi_lora.json), the engine's limits (config.pbtxt parameters) and the OpenAI shim's flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# An adapter name is a model name of the OpenAI API: no whitespace, no quote that would break a config.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]*")


def adapter_module(item: str) -> tuple[str, str]:
    """One `--lora NAME=PATH` as (name, absolute folder); argparse reports a failure as `argument --lora: ...`."""
    name, sep, path = item.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {item!r}")
    if not ADAPTER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"adapter name {name!r} must start with a letter or digit and hold no "
                                         "spaces or quotes")
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of adapter {name!r} does not exist: {folder}")
    return name, str(folder)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the LoRA options of `serve`."""
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--lora", "--lora-modules", action="extend", nargs="+", type=adapter_module, default=[],
                       metavar="NAME=PATH", help="serve the PEFT adapter in folder PATH as model NAME (repeatable, "
                       "or several after one flag as vLLM's --lora-modules; turns LoRA on)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters even with no --lora (ones loaded at run time)")
    group.add_argument("--max-loras", type=int, default=None, help="adapters resident for the batch at once")
    group.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank served")
    group.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in CPU memory at once")
    group.add_argument("--enable-lora-runtime-updates", action="store_true",
                       help="load and unload adapters at run time (the shim's /v1/load_lora_adapter and "
                            "/v1/unload_lora_adapter, the llm model's lora_control; vLLM's "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    group.add_argument("--lora-separator", default=None, metavar="SEP",
                       help="the shim also answers to MODEL<SEP>ADAPTER names (Triton's OpenAI frontend)")


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """The --lora adapters by name; a name given twice is refused."""
    modules: dict[str, str] = {}
    for name, folder in args.lora:
        if name in modules:
            raise SystemExit(f"--lora {name}: the name is given twice")
        modules[name] = folder
    return modules


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
