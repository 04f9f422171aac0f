"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

`triton.jit` picks the interpreter when a kernel module is imported, so the switch is set here, before
any test module imports pagedserve's Triton kernels.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
