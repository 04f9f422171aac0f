"""The ensemble's tokenizing step."""

from pagedserve.backend.triton.ensemble import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
