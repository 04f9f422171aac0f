"""The tokenizing step on its own (the ensemble tokenizes in its own process)."""

from pagedserve.backend.triton_ensemble import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
