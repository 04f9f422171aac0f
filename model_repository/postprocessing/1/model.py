"""The ensemble's detokenizing step."""

from pagedserve.backend.triton.utils import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
