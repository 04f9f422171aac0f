"""Faults a test triggers in a real engine, for tests/reliability: a step that schedules a request whose text
prompt holds FAULT_MARKER raises once, as a failing forward would; a structured-output spec whose JSON holds
it compiles SLOW_COMPILE_SECONDS later, as a large schema on a real vocabulary would; and a step that schedules a
request whose prompt holds PACE_MARKER takes PACE_SECONDS longer, as a large model's would, so a test that must act
while a request still runs (cancel it, count it) has time to, however fast the tiny model decodes. `install_fault_model`
makes a model repository's llm model tests/support/fault_model.py, which arms them on its engine."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedserve.backend.engine.llm_engine import LLMEngine

FAULT_MARKER = "@@inject-step-fault@@"
SLOW_COMPILE_SECONDS = 2.0
PACE_MARKER = "@@paced@@"
PACE_SECONDS = 0.02
REPOSITORY_ROOT = Path(__file__).resolve().parents[2]  # where `tests` imports from

_MODEL_FILE = '''"""The llm model with the faults of tests/support/faults.py: written by the tests, never served otherwise."""

import sys

sys.path.insert(0, {root!r})

from tests.support.fault_model import TritonPythonModel  # noqa: E402

__all__ = ["TritonPythonModel"]
'''


def _before_marked_steps(engine: LLMEngine, marker: str, act: Callable[[set[str], set[str]], None]) -> None:
    """Call act(hit, marked) before each forward whose step schedules requests (`hit`) that were added with
    `marker` in their prompt; `marked` is every such request still known, for act to forget some."""
    marked: set[str] = set()  # engine thread only, as add_request and step are
    add_request, execute = engine.add_request, engine.runner.execute

    def add_marked(request_id: str, prompt: str | None, *args: Any, **kwargs: Any) -> None:
        add_request(request_id, prompt, *args, **kwargs)
        if prompt and marker in prompt:
            marked.add(request_id)

    def marked_execute(scheduler_output: Any) -> Any:
        hit = {item.request.group_id or item.request.request_id for item in scheduler_output.scheduled} & marked
        if hit:
            act(hit, marked)
        return execute(scheduler_output)

    engine.add_request, engine.runner.execute = add_marked, marked_execute


def arm_step_fault(engine: LLMEngine, marker: str = FAULT_MARKER) -> None:
    """Make the runner's forward raise, once per request, in a step that schedules a request added with
    `marker` in its prompt (the engine then ends that step's requests with the error)."""

    def fail(hit: set[str], marked: set[str]) -> None:
        marked.difference_update(hit)
        raise RuntimeError(f"injected fault for {sorted(hit)}")

    _before_marked_steps(engine, marker, fail)


def arm_pacing(engine: LLMEngine, marker: str = PACE_MARKER, seconds: float = PACE_SECONDS) -> None:
    """Make every step that schedules a request added with `marker` in its prompt take `seconds` longer."""
    _before_marked_steps(engine, marker, lambda hit, marked: time.sleep(seconds))


def slow_compiles(engine: LLMEngine, marker: str = FAULT_MARKER, seconds: float = SLOW_COMPILE_SECONDS) -> None:
    """Make a structured-output spec whose JSON holds `marker` take `seconds` longer to compile (on the
    grammar thread, where compiles run)."""
    structured = engine.structured
    compile_spec = structured._compile

    def slow_compile(spec: dict) -> Any:
        if marker in json.dumps(spec):
            time.sleep(seconds)
        return compile_spec(spec)

    structured._compile = slow_compile


def install_fault_model(repository: Path) -> None:
    """Serve tests/support/fault_model.py as `repository`'s llm model (importable from this checkout)."""
    (repository / "llm" / "1" / "model.py").write_text(_MODEL_FILE.format(root=str(REPOSITORY_ROOT)))
