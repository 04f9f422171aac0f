"""pagedserve: a paged-KV-cache LLM serving engine inside NVIDIA Triton Inference Server."""

import os
import sys

# OpenMP workers that spin while waiting stall small kernels on a shared or oversubscribed CPU (figures in
# docs/benchmarks.md). libgomp reads this once, when torch loads, so it is set before anything here imports
# torch. When torch was loaded first it is too late; the CPU model runner then keeps to one intra-op thread.
OPENMP_MAY_SPIN = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
