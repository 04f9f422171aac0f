"""The ensemble with TensorRT-LLM's tensors: tokenize, stream each batch row through `llm`, detokenize."""

from pagedserve.backend.triton.ensemble import EnsembleModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
