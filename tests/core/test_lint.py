"""The code is ruff-clean (pyproject's rules), checked on every run rather than left to a lint target nobody runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing_in_the_package_tests_and_benchmarks():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    proc = subprocess.run([ruff, "check", "--no-cache", "pagedserve", "tests", "bench"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
