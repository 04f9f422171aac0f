"""The native CPU kernels' library: every op folder's `.cpp`, compiled once with the system C++ compiler.

The sources have no torch headers (plain C ABI, called through ctypes, which releases the GIL), so the
library builds in seconds with `-O3 -march=native` for the machine it runs on, into `<cache>/kernels/`,
keyed by a hash of the sources, flags, compiler and CPU. Where no compiler is found, the build fails, or
`PAGEDSERVE_CPU_KERNELS=0`, load() is None and the CPU kernels use the torch reference.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedserve.kernels.dispatch import EnvSwitch

logger = logging.getLogger(__name__)

_KERNELS = Path(__file__).resolve().parent.parent
# Each op keeps its C++ beside its Python; sorted, so the cache key does not depend on the file system.
SOURCES = tuple(sorted(_KERNELS.glob("*/*.cpp")))
HEADERS = tuple(sorted(_KERNELS.glob("native/*.h")))
ENV_SWITCH = "PAGEDSERVE_CPU_KERNELS"
CACHE_ENV = "PAGEDSERVE_CACHE"
# -fopenmp links the libgomp torch already loaded (one soname): the kernels share torch's team of threads.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno")
# The `dtype` argument of the entry points (DType in cpu_common.h).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_SWITCH = EnvSwitch(ENV_SWITCH)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False


def enabled() -> bool:
    """False when PAGEDSERVE_CPU_KERNELS is 0/false/off/torch."""
    value = _SWITCH.get()
    return value is None or value.strip().lower() not in ("0", "false", "off", "no", "torch")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: a cache folder shared between different CPUs must not mix builds."""
    keys = ("flags", "Features", "model name", "CPU part")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            first_cpu = info.read().split("\n\n", 1)[0]
    except OSError:
        first_cpu = ""
    lines = [line for line in first_cpu.splitlines() if line.startswith(keys)]
    return "\n".join([os.uname().machine, *lines])


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    parts = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(FLAGS).encode(), version.encode(), _cpu_signature().encode()):
        digest.update(part)
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedserve")
    return root / "kernels" / f"pagedserve_cpu-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile each source on its own core, link into a temporary file, then rename: concurrent builders never
    load a half-written library. A lock beside the target makes a second process (another test worker, another
    engine) wait for the first build instead of repeating it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        with tempfile.TemporaryDirectory(prefix=target.stem, dir=target.parent) as work:
            compile_flags = [flag for flag in FLAGS if flag != "-shared"]
            objects = [Path(work, f"{index}-{src.stem}.o") for index, src in enumerate(SOURCES)]
            commands = [[compiler, *compile_flags, "-c", str(src), "-o", str(obj)]
                        for src, obj in zip(SOURCES, objects, strict=True)]
            with ThreadPoolExecutor(max(1, min(len(commands), os.cpu_count() or 1))) as pool:
                list(pool.map(_run_compiler, commands))
            tmp = Path(work, "library.so")
            _run_compiler([compiler, *FLAGS, *map(str, objects), "-o", str(tmp)])
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)


def _run_compiler(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {result.stderr.strip()[-2000:]}")


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (with one warning) where it cannot be had."""
    global _library, _load_failed
    if not enabled():
        return None
    if _library is not None or _load_failed:
        return _library
    with _lock:
        if _library is not None or _load_failed:
            return _library
        try:
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
            path = _library_path(compiler)
            if not path.exists():
                logger.info("building the native CPU kernels into %s", path)
                _build(compiler, path)
            _library = ctypes.CDLL(str(path))
        except Exception as exc:  # any failure means the torch path, never a broken engine
            _load_failed = True
            logger.warning("native CPU kernels unavailable (%s); using the torch reference", exc)
    return _library


def dtype_code(tensor: torch.Tensor) -> int | None:
    """The kernels' code for this tensor's dtype, None where they do not serve it."""
    return _DTYPE_CODES.get(tensor.dtype) if tensor.is_cpu else None


class Function:
    """One entry point of the library, declared beside the op that calls it; every entry returns a status.

    `value_errors` maps a status to the message of the ValueError it means (bad input, not a fault).
    """

    def __init__(self, name: str, argtypes: list, value_errors: dict[int, str] | None = None) -> None:
        self.name, self._argtypes, self._value_errors = name, argtypes, value_errors or {}
        self._library: ctypes.CDLL | None = None
        self._function = None

    def __call__(self, *args: object) -> None:
        """Run it (callers check load() first); a non-zero status raises."""
        library = _library or load()
        if library is None:
            raise RuntimeError(f"native {self.name} called without the native library")
        if library is not self._library:
            function = getattr(library, self.name)
            function.restype, function.argtypes = ctypes.c_int, self._argtypes
            self._function, self._library = function, library
        status = self._function(*args)
        if status in self._value_errors:
            raise ValueError(self._value_errors[status])
        if status != 0:
            raise RuntimeError(f"native {self.name} failed with status {status}")


def serves(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a CPU fp32/bf16 tensor of one dtype and the library loads."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPE_CODES:
        return False
    for tensor in tensors:  # a loop, not all() over a generator: this runs for every kernel call
        if tensor.dtype != dtype or not tensor.is_cpu:
            return False
    return load() is not None
