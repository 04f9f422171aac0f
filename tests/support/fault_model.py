"""pagedserve's llm model with tests/support/faults.py's faults armed on its engine. It runs inside a Triton
Python stub (it imports pb_utils through llm_model); install_fault_model puts it in a test's model repository."""

from __future__ import annotations

from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.triton.llm_model import TritonPythonModel as LLMModel
from tests.support.faults import arm_pacing, arm_step_fault, slow_compiles


class TritonPythonModel(LLMModel):
    """The llm model whose engine fails a step for FAULT_MARKER, compiles a grammar holding it slowly and takes
    longer over steps that run a PACE_MARKER request."""

    def load_engine(self) -> LLMEngine:
        engine = super().load_engine()
        arm_step_fault(engine)
        slow_compiles(engine)
        arm_pacing(engine)
        return engine
