"""The ensemble's tokenizing step."""

from pagedserve.backend.triton_utils import PreprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
