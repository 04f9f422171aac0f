"""The generated model repository of a run: the pagedserve repository copied with the model path, the llm
engine parameters and the llm model's instance_group filled into its config.pbtxt files."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

# The repository ships inside the package (package data), so a wheel install serves as an editable one does.
DEFAULT_MODEL_REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
# Parameter keys filled with the model path in every model of the repository that declares them.
MODEL_PATH_KEYS = ("model", "tokenizer")
LLM_MODEL_NAME = "llm"
MULTI_LORA_FILE = "multi_lora.json"  # the same as pagedserve/backend/triton/lora.py's


def fill_parameters(config_text: str, values: Mapping[str, str], *, strict: bool = False) -> str:
    """Set the string_value of the named `parameters` entries of a config.pbtxt text.

    With `strict`, a key the config does not declare is an error (a typo in `--param`).
    """
    for key, value in values.items():
        pattern = re.compile(
            r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*)"(?:[^"\\]|\\.)*"'
        )
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        config_text, count = pattern.subn(lambda m, v=escaped: f'{m.group(1)}"{v}"', config_text)
        if strict and count == 0:
            raise ValueError(f"--param {key}: the {LLM_MODEL_NAME} model has no parameter named {key!r}")
    return config_text


def _instance_group_span(config_text: str) -> tuple[int, int] | None:
    """Where a config.pbtxt's `instance_group [...]` is (not one in a comment); None without one."""
    found = re.search(r"^[ \t]*instance_group\s*\[", config_text, re.MULTILINE)
    if found is None:
        return None
    depth, end = 0, found.end() - 1
    while True:  # to the bracket closing the group list (a group's `gpus: [...]` nests one)
        depth += {"[": 1, "]": -1}.get(config_text[end], 0)
        end += 1
        if depth == 0:
            return found.start(), end


def set_instance_group(config_text: str, count: int, kind: str | None = None) -> str:
    """Replace a config.pbtxt's instance_group with one group of `count` instances of `kind` (KIND_CPU,
    KIND_GPU or KIND_MODEL; None keeps the kind of the config's first group, KIND_CPU without one)."""
    if count < 1:
        raise ValueError(f"--instances must be at least 1, got {count}")
    span = _instance_group_span(config_text)
    if kind is None:
        found = re.search(r"kind:\s*(KIND_\w+)", config_text[span[0]:span[1]]) if span else None
        kind = found.group(1) if found else "KIND_CPU"
    group = f"instance_group [ {{ count: {count} kind: {kind} }} ]"
    if span is None:
        return f"{config_text.rstrip()}\n{group}\n"
    return config_text[:span[0]] + group + config_text[span[1]:]


def write_multi_lora(version_dir: Path, adapters: Mapping[str, str]) -> None:
    """Add `adapters` (name -> folder) to the llm model's multi_lora.json, the file Triton's vLLM backend reads
    beside its model; a name the file already has is refused."""
    path = version_dir / MULTI_LORA_FILE
    entries = json.loads(path.read_text()) if path.exists() else {}
    for name in adapters:
        if name in entries:
            raise ValueError(f"--lora {name}: {path} already has an adapter of that name")
    path.write_text(json.dumps({**entries, **adapters}, indent=2) + "\n")


def prepare_model_repository(
    source: Path, target: Path, model: str | None, llm_params: Mapping[str, str] | None = None,
    llm_instances: tuple[int, str | None] | None = None, lora_adapters: Mapping[str, str] | None = None,
) -> Path:
    """Copy the repository to `target`, filling the model path and the llm engine parameters, with
    `llm_instances` = (count, kind or None) the llm model's instance_group (set_instance_group), and with
    `lora_adapters` (name -> folder) its multi_lora.json."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    if lora_adapters:
        write_multi_lora(target / LLM_MODEL_NAME / "1", lora_adapters)
    paths = {key: model for key in MODEL_PATH_KEYS} if model else {}
    if model:
        paths["tokenizer"] = str(tokenizer_folder(model))
    for config in sorted(target.glob("*/config.pbtxt")):
        text = fill_parameters(config.read_text(), paths)
        if config.parent.name == LLM_MODEL_NAME and llm_params:
            text = fill_parameters(text, llm_params, strict=True)
        if config.parent.name == LLM_MODEL_NAME and llm_instances is not None:
            text = set_instance_group(text, *llm_instances)
        config.write_text(text)
    return target


def tokenizer_folder(model: str | Path) -> Path:
    """The folder a model's tokenizer and chat template are read from: the model folder itself, or for a .gguf
    file (which the llm model serves as it is) a folder made once from the file's metadata."""
    if str(model).endswith(".gguf"):
        from pagedserve.backend.model.gguf_tokenizer import tokenizer_dir

        return tokenizer_dir(model)
    return Path(model)
