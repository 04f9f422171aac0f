"""Compile the Triton kernels for a GPU target on a machine without one, to check registers and spills.

The launchers run on small CPU tensors while their kernels are swapped for recorders; each recorded
launch is specialised as Triton's JIT would (16-byte aligned pointers, ints divisible by 16, ints equal
to 1) and compiled to a cubin whose resource usage cuobjdump (shipped in the triton wheel) reports.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
                 torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
SM90_MAX_SHARED_BYTES = 232448  # 227 KB per block on H100/H200


@dataclass
class Launch:
    """One recorded kernel launch: the jit function, its arguments and launch options."""

    fn: triton.runtime.JITFunction
    args: tuple
    kwargs: dict = field(default_factory=dict)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` records the launch instead of running it."""

    def __init__(self, fn: triton.runtime.JITFunction, launches: list[Launch]) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.fn, args, kwargs))


@contextlib.contextmanager
def record_launches(*modules: ModuleType) -> Iterator[list[Launch]]:
    """Within the block, every `_..._kernel` of these modules records its launches into the yielded list."""
    launches: list[Launch] = []
    originals = {(m, n): getattr(m, n) for m in modules for n in dir(m) if n.startswith("_") and n.endswith("_kernel")}
    for (module, name), fn in originals.items():
        setattr(module, name, _Recorder(fn, launches))
    try:
        yield launches
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def specialise(launch: Launch) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) as Triton's JIT would specialise this launch."""
    fn = launch.fn
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}
    values = dict(zip(fn.arg_names, launch.args, strict=False))
    values.update({k: v for k, v in launch.kwargs.items() if k not in options})
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = values[name]
        if i in fn.constexprs:
            signature[name], constexprs[name] = "constexpr", tl.constexpr(value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", tl.constexpr(1)
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack bytes (spills) and local bytes of the cubin's kernel."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]), "local_bytes": int(found["LOCAL"])}


def compile_launch(launch: Launch, arch: int = 90) -> dict:
    """Compile one recorded launch for sm_<arch>; its constexprs, shared memory and resource usage."""
    signature, constexprs, attrs, options = specialise(launch)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    compiled = triton.compile(ASTSource(fn=launch.fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=target, options=backend.parse_options(options).__dict__)
    shown = {k: str(v.value) if isinstance(v.value, tl.dtype) else v.value for k, v in constexprs.items()}
    return {"kernel": launch.fn.__name__, **options, "constexprs": shown, "shared_bytes": compiled.metadata.shared,
            **resource_usage(compiled.asm["cubin"])}
