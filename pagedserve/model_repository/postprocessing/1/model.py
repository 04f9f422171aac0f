"""The detokenizing step on its own (the ensemble detokenizes in its own process)."""

from pagedserve.backend.triton.ensemble import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
