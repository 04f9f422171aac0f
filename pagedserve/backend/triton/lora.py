"""The llm model's LoRA adapters as Triton's vLLM backend configures them, `multi_lora.json` (adapter name ->
folder) in the model's version folder, and the `lora_control` request that lists, loads and unloads them.

A `lora_control` request carries one JSON object instead of a prompt: {"action": "list"}, {"action": "load",
"lora_name": ..., "lora_path": ...} or {"action": "unload", "lora_name": ...} (vLLM's body fields). Its one
response is `text_output` [1]: {"message": ..., "lora_adapters": {name: folder}}, the adapters after the action.
Load and unload are refused unless the config.pbtxt parameter enable_lora_runtime_updates is true, and with
more than one instance (each has its own engine, and Triton gives a request to one of them). A load of a
lora_path that is no folder is refused naming field lora_path, any other failed load naming the adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError, json_object
from pagedserve.backend.triton.inputs import string_input
from pagedserve.backend.triton.protocols import EngineClient
from pagedserve.backend.triton.settings import LORA_RUNTIME_UPDATES_PARAMETER

MULTI_LORA_FILE = "multi_lora.json"
CONTROL_INPUT = "lora_control"
CONTROL_ACTIONS = ("list", "load", "unload")
_CONTROL_FIELDS = {"action", "lora_name", "lora_path"}
MAX_CONTROL_BYTES = 64 * 1024


def read_multi_lora(version_dir: Path) -> dict[str, str]:
    """{name: folder} of `multi_lora.json` in `version_dir` ({} without one); relative folders are relative to
    the file. ValueError naming the file and the entry for anything that is not a name -> existing folder."""
    path = version_dir / MULTI_LORA_FILE
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a readable JSON file: {error}") from None
    if not isinstance(entries, dict):
        raise ValueError(f"{path} must hold a JSON object of adapter name -> folder, got {type(entries).__name__}")
    modules = {}
    for name, folder in entries.items():
        if not name.strip() or not isinstance(folder, str) or not folder.strip():
            raise ValueError(f"{path}: adapter {name!r} must map a non-empty name to a folder path, got {folder!r}")
        full = (path.parent / Path(folder).expanduser()).resolve()
        if not full.is_dir():
            raise ValueError(f"{path}: the folder of LoRA adapter {name!r} does not exist: {full}")
        modules[name] = str(full)
    return modules


def lora_engine_kwargs(kwargs: dict[str, Any], version_dir: Path) -> dict[str, Any]:
    """The engine kwargs with multi_lora.json's adapters as `lora_modules`; adapters with LoRA off are refused
    (rather than served as the base model)."""
    modules = read_multi_lora(version_dir)
    if not modules:
        return kwargs
    if not kwargs.get("enable_lora"):
        raise ValueError(f"{version_dir / MULTI_LORA_FILE} lists LoRA adapters ({', '.join(modules)}) but the "
                         "config.pbtxt parameter enable_lora is not true")
    return {**kwargs, "lora_modules": modules}


def model_instances(config: dict[str, Any]) -> int:
    """How many instances (engines) the model runs, over every instance group and GPU."""
    groups = config.get("instance_group") or [{"count": 1}]
    return sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups)


@dataclass(frozen=True)
class LoRAControl:
    """One validated lora_control request."""

    action: str
    lora_name: str = ""
    lora_path: str = ""


def _required_text(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}", name)
    return value.strip()


def control_request(tensors: dict[str, Any], runtime_updates: bool, instances: int) -> LoRAControl:
    """The lora_control of a request's input tensors (it must carry no prompt), validated."""
    if "text_input" in tensors or "input_ids" in tensors:
        raise InvalidRequestError("a lora_control request is one of its own: send it without text_input or "
                                  "input_ids", CONTROL_INPUT)
    return parse_lora_control(string_input(tensors, CONTROL_INPUT, MAX_CONTROL_BYTES) or "", runtime_updates,
                              instances)


def parse_lora_control(raw: str, runtime_updates: bool, instances: int) -> LoRAControl:
    """Validate a lora_control JSON object; load and unload only where runtime updates are on and one engine runs."""
    body = json_object(raw, CONTROL_INPUT)
    unknown = sorted(set(body) - _CONTROL_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown lora_control field {unknown[0]!r}; allowed: "
                                  f"{', '.join(sorted(_CONTROL_FIELDS))}", unknown[0])
    action = body.get("action")
    if action not in CONTROL_ACTIONS:
        raise InvalidRequestError(f"action must be one of {', '.join(CONTROL_ACTIONS)}, got {action!r}", "action")
    if action == "list":
        return LoRAControl(action)
    if not runtime_updates:
        raise InvalidRequestError(
            f"loading and unloading LoRA adapters at run time is off: set the llm model's config.pbtxt parameter "
            f"{LORA_RUNTIME_UPDATES_PARAMETER} to true (pagedserve serve --enable-lora-runtime-updates)", CONTROL_INPUT)
    if instances > 1:
        raise InvalidRequestError(
            f"loading and unloading LoRA adapters at run time needs one llm instance; this model runs {instances}, "
            f"each with its own engine: list the adapters in {MULTI_LORA_FILE} instead", CONTROL_INPUT)
    name = _required_text(body, "lora_name")
    return LoRAControl(action, name, _required_text(body, "lora_path") if action == "load" else "")


def run_lora_control(engine: EngineClient, control: LoRAControl) -> dict[str, Any]:
    """Apply one control on the engine thread; its answer. A load whose lora_path is no folder is refused
    naming field lora_path (the shim's 404, vLLM's missing adapter); the engine's refusals (an adapter that does
    not load, one in use, an unknown name) raise InvalidRequestError naming the adapter."""
    message = ""
    if control.action == "load":
        if not Path(control.lora_path).is_dir():
            raise InvalidRequestError(f"LoRA adapter {control.lora_name!r}: no adapter found at {control.lora_path} "
                                      "(no such folder)", "lora_path")
        engine.add_lora(control.lora_name, control.lora_path)
        message = f"Success: LoRA adapter '{control.lora_name}' added successfully."
    elif control.action == "unload":
        engine.remove_lora(control.lora_name)
        message = f"Success: LoRA adapter '{control.lora_name}' removed successfully."
    return {"message": message, "lora_adapters": dict(engine.list_loras())}


def lora_info_labels(stats: Any) -> dict[str, str] | None:
    """vLLM's vllm:lora_requests_info labels of an EngineStats snapshot: the adapters of the running and of the
    waiting requests (comma-separated names) and max_lora; None while LoRA is off (max_lora 0)."""
    max_lora = int(getattr(stats, "max_lora", 0) or 0)
    if not max_lora:
        return None

    def names(value: Any) -> str:
        return value if isinstance(value, str) else ",".join(sorted(value))

    return {"running_lora_adapters": names(stats.running_lora_adapters),
            "waiting_lora_adapters": names(stats.waiting_lora_adapters), "max_lora": str(max_lora)}
