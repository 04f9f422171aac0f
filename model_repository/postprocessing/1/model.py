"""The ensemble's detokenizing step."""

from pagedserve.backend.triton.ensemble import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
