"""The engine core (request, sampling params, config, errors, block manager, scheduler, outputs) is plain
Python: importing it, or any module of it, in a fresh interpreter loads no torch."""

from __future__ import annotations

import importlib.util
import pkgutil
import subprocess
import sys

import pytest

CORE = "pagedserve.backend.core"
MODULES = [CORE, *(f"{CORE}.{m.name}" for m in pkgutil.iter_modules(importlib.util.find_spec(CORE)
                                                                     .submodule_search_locations))]
LOADED_TORCH = "import importlib, sys; importlib.import_module(sys.argv[1]); print('torch' in sys.modules)"


def test_the_core_has_the_modules_this_test_expects_to_check():
    expected = {f"{CORE}.{name}" for name in ("block_manager", "request", "scheduler", "sampling_params")}
    assert expected <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_importing_a_core_module_in_a_fresh_interpreter_loads_no_torch(module):
    loaded = subprocess.run([sys.executable, "-c", LOADED_TORCH, module], capture_output=True, text=True,
                            timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "False", f"importing {module} loaded torch"
