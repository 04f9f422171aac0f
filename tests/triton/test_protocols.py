"""The Protocols the llm model's threads are written against match what the model hands them: LLMEngine is an
EngineClient (every method, with the same parameters), EngineMetrics a Metrics, OutputEncoder an Encoder."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.structured import StructuredOutputs
from pagedserve.backend.triton import protocols


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(("protocol", "implementation"), [
    (protocols.EngineClient, LLMEngine),
    (protocols.GrammarCompiler, StructuredOutputs),
])
def test_the_engine_has_every_method_the_engine_loop_calls_with_the_same_parameters(protocol, implementation):
    for name in _methods(protocol):
        assert _parameters(getattr(implementation, name)) == _parameters(getattr(protocol, name)), name


def test_the_encoder_metrics_and_responses_of_the_model_implement_their_protocols():
    # Their modules import pb_utils, which only a Triton stub has: their source is read instead.
    folder = Path(protocols.__file__).parent
    for protocol, module, cls in [(protocols.Encoder, "encoding.py", "OutputEncoder"),
                                  (protocols.Metrics, "metrics.py", "EngineMetrics"),
                                  (protocols.ResponseFactory, "tensors.py", "TritonResponses")]:
        tree = ast.parse((folder / module).read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        defined = {f.name: [a.arg for a in f.args.args] for f in node.body if isinstance(f, ast.FunctionDef)}
        for name in _methods(protocol):
            expected = [p.name for p in inspect.signature(getattr(protocol, name)).parameters.values()]
            assert defined.get(name) == expected, f"{cls}.{name}"
