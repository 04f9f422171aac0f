"""pagedserve: a paged-KV-cache LLM serving engine inside NVIDIA Triton Inference Server."""

__version__ = "0.1.0"
