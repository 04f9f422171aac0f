"""pagedserve: a paged-KV-cache LLM serving engine inside NVIDIA Triton Inference Server."""

import os

# OpenMP workers that spin while waiting turn a shared or oversubscribed CPU into a 100x slowdown of small
# kernels (measured: one 576-wide decode attention went from 34 us to 13 ms with two spinning threads under
# load). libgomp reads this once, when torch loads, so it is set before anything here imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
