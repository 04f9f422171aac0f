"""The `llm` model: pagedserve's engine behind Triton's decoupled Python backend."""

from pagedserve.backend.triton.llm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
