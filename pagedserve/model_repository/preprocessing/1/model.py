"""The tokenizing step on its own (the ensemble tokenizes in its own process)."""

from pagedserve.backend.triton.ensemble import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
