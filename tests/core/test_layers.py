"""The layers of docs/architecture.md import only the layers below them (read from the source, not run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folder of the repository -> the package it installs as.
PACKAGES = {"pagedserve/backend": "pagedserve.backend", "pagedserve/kernels": "pagedserve.kernels",
            "pagedserve/client": "pagedserve.client"}
# Layer -> the other layers it may import. `pagedserve` is the package root (its start-up settings).
ALLOWED = {
    "backend": set(),  # the package's own __init__
    "backend.core": set(),
    "backend.model": {"kernels", "pagedserve"},
    "backend.worker": {"backend.core", "backend.model", "kernels", "pagedserve"},
    "backend.structured": {"backend.core", "kernels"},
    "backend.engine": {"backend.core", "backend.model", "backend.structured", "backend.worker"},
    "backend.triton": {"backend.core", "backend.engine", "backend.model", "backend.worker"},
    "kernels": set(),
    "client": {"backend.core", "backend.model", "client.openai"},
    "client.openai": {"backend.core", "client"},
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pagedserve":
        return None
    if len(parts) == 1:
        return "pagedserve"
    if parts[1] == "backend":
        return f"backend.{parts[2]}" if len(parts) > 2 else "backend"
    if parts[1] == "client":
        return "client.openai" if len(parts) > 2 and parts[2] == "openai" else "client"
    return parts[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _sources() -> list[tuple[str, Path]]:
    sources = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"]
            module = ".".join([package, *parts])
            sources.append((_layer(module), path))
    return sources


def test_every_source_file_is_in_a_known_layer():
    assert {layer for layer, _ in _sources()} == set(ALLOWED)


@pytest.mark.parametrize(("layer", "path"), _sources(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v)
def test_a_layer_imports_only_the_layers_below_it(layer, path):
    imported = {_layer(module) for module in _imports(path)} - {None, layer}
    assert imported <= ALLOWED[layer], f"{path.relative_to(ROOT)} ({layer}) imports {sorted(imported - ALLOWED[layer])}"
