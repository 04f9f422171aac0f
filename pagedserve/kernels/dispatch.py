"""The one choice of kernel backend, made per call from the tensor and `PAGEDSERVE_KERNELS`.

`auto` (the default): Triton on CUDA tensors when triton is installed, the engine's CPU kernels on CPU
tensors (native where they serve the tensors, else the torch reference), the reference elsewhere.
`triton` forces Triton (on CPU tensors only under `TRITON_INTERPRET=1`); `torch` keeps the pure
reference, the oracle. Triton modules are imported on first use, so CPU hosts need no triton.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType

import torch

ENV = "PAGEDSERVE_KERNELS"
_MODES = ("auto", "triton", "torch")
_triton_installed: bool | None = None


class Backend(enum.Enum):
    """Who runs an op: the torch reference, the engine's CPU kernels, or Triton."""

    TORCH = "torch"
    CPU = "cpu"
    TRITON = "triton"


def _has_triton() -> bool:
    global _triton_installed
    if _triton_installed is None:
        _triton_installed = importlib.util.find_spec("triton") is not None
    return _triton_installed


class EnvSwitch:
    """An environment variable read on every call (tests and users change it at run time), cheaply.

    os.environ encodes the key and decodes the value on each read, and the kernels read their switches
    a dozen times a layer; on POSIX CPython this reads the bytes mapping that os.environ writes through to.
    """

    _environ = os.environ
    _data: dict | None = getattr(os.environ, "_data", None) if os.name == "posix" else None

    def __init__(self, name: str) -> None:
        self.name, self._key = name, os.fsencode(name)

    def get(self) -> str | None:
        """The variable's value, None when unset."""
        if self._data is None or os.environ is not self._environ:  # os.environ replaced: read the new one
            return os.environ.get(self.name)
        raw = self._data.get(self._key)
        return None if raw is None else os.fsdecode(raw)


_MODE_SWITCH = EnvSwitch(ENV)


def mode() -> str:
    """The `PAGEDSERVE_KERNELS` setting: auto, triton or torch; anything else is refused by name."""
    raw = _MODE_SWITCH.get()
    if raw is None:  # the common case: a dozen dispatches per layer, so no string work
        return "auto"
    chosen = raw.strip().lower() or "auto"
    if chosen not in _MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(_MODES)}; got {chosen!r}")
    return chosen


def backend_for(tensor: torch.Tensor) -> Backend:
    """The backend that serves an op whose main operand is this tensor."""
    chosen = mode()
    if chosen == "auto" and not tensor.is_cuda:  # the CPU engine's every call: no triton lookup
        return Backend.CPU if tensor.device.type == "cpu" else Backend.TORCH
    if chosen == "torch":
        return Backend.TORCH
    if chosen == "triton":
        if not _has_triton():
            raise RuntimeError(f"{ENV}=triton but the triton package is not installed")
        return Backend.TRITON
    if tensor.is_cuda and _has_triton():
        return Backend.TRITON
    return Backend.CPU if tensor.device.type == "cpu" else Backend.TORCH


class Implementations:
    """One op folder's modules, one per backend, each defining the folder's ops under the same names.

    A backend without a module of its own runs the reference; the Triton module is loaded on first use.
    """

    def __init__(
        self,
        reference: ModuleType,
        cpu: ModuleType | None = None,
        load_triton: Callable[[], ModuleType] | None = None,
    ) -> None:
        self._modules = {Backend.TORCH: reference, Backend.CPU: cpu or reference}
        self._load_triton = load_triton or (lambda: reference)

    def select(self, tensor: torch.Tensor) -> ModuleType:
        """The module whose functions run for this tensor."""
        backend = backend_for(tensor)
        module = self._modules.get(backend)
        if module is None:
            module = self._modules[backend] = self._load_triton()
        return module
