"""pyproject.toml lists every package folder explicitly (the repository's folders map onto `pagedserve.*`), so a
folder added without its entry would be left out of a wheel while the editable install still imports it."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
_ROOTS = {"pagedserve.backend": "backend", "pagedserve.kernels": "kernels", "pagedserve.client": "client"}


def _package_folders() -> dict[str, str]:
    found = {"pagedserve": "pagedserve"}
    for name, folder in _ROOTS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            if "__pycache__" in rel.parts:
                continue
            found[".".join([name, *rel.parts[1:]])] = rel.as_posix()
    return found


def test_every_package_folder_is_listed_in_pyproject_with_its_folder():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = _package_folders()
    assert sorted(folders) == sorted(setuptools["packages"])
    assert {name: setuptools["package-dir"][name] for name in folders if name in setuptools["package-dir"]} == folders
