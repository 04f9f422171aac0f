"""What a wheel carries is found, not listed: every package under pagedserve/, every native source and the model
repository as package data (a hand-kept list once dropped two C++ kernels and the model repository)."""

from __future__ import annotations

from pathlib import Path

import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagedserve"


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_python_under_the_package_is_a_found_package():
    found = set(find_packages(str(ROOT), include=_setuptools()["packages"]["find"]["include"]))
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts
               and "model_repository" not in path.relative_to(PACKAGE).parts}
    assert {".".join(folder.relative_to(ROOT).parts) for folder in folders} <= found


def test_no_top_level_folder_shadows_an_importable_name_but_the_package():
    importable = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert importable <= {"pagedserve", "tests"}


def _package_data_files() -> set[Path]:
    """The files the package-data globs take, expanded as setuptools does (`**` recursive)."""
    return {path for package, patterns in _setuptools()["package-data"].items() for pattern in patterns
            for path in ROOT.joinpath(*package.split(".")).glob(pattern) if path.is_file()}


def test_every_native_source_and_the_model_repository_are_package_data():
    wanted = [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts
              and (p.suffix in {".cpp", ".h"} or "model_repository" in p.relative_to(PACKAGE).parts)]
    assert any(p.suffix == ".cpp" for p in wanted) and any(p.name == "config.pbtxt" for p in wanted)
    assert sorted(str(p.relative_to(ROOT)) for p in set(wanted) - _package_data_files()) == []
