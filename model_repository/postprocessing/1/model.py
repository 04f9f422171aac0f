"""The ensemble's detokenizing step."""

from pagedserve.backend.triton_utils import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
