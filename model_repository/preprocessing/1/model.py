"""The ensemble's tokenizing step."""

from pagedserve.backend.triton.utils import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
