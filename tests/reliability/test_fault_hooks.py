"""The faults tests/reliability triggers through its test model (tests/support/faults.py), on an in-process
engine: a marked request fails the step that schedules it, once, with the engine serving on; a marked grammar
compiles late. Fast, so a change in how the engine runs a step shows here before the server tests."""

from __future__ import annotations

import time

from tests.support.engines import cpu_engine, greedy, run_to_end
from tests.support.faults import FAULT_MARKER, arm_step_fault, slow_compiles


def test_a_step_scheduling_a_marked_request_fails_once_and_the_engine_serves_on(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path)
    arm_step_fault(engine)
    engine.add_request("doomed", f"Doomed {FAULT_MARKER} request", greedy(4))
    doomed = run_to_end(engine)["doomed"]
    assert doomed.error.startswith("RuntimeError: injected fault for ['doomed']"), doomed.error
    engine.add_request("again", f"{FAULT_MARKER} again", greedy(4))
    engine.add_request("unmarked", "A request after the fault", greedy(4))
    outputs = run_to_end(engine)
    assert "injected fault for ['again']" in outputs["again"].error  # one step: the unmarked one shares it
    engine.add_request("after", "A request after the fault", greedy(4))
    after = run_to_end(engine)["after"]
    assert after.error is None and len(after.outputs[0].token_ids) == 4


def test_a_marked_grammar_compiles_late_and_others_at_once(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path)
    slow_compiles(engine, seconds=0.5)
    started = time.monotonic()
    engine.structured.compile({"json": {"enum": ["x", "y"]}})
    plain = time.monotonic() - started
    started = time.monotonic()
    engine.structured.compile({"json": {"$comment": FAULT_MARKER, "enum": ["x", "y"]}})
    assert time.monotonic() - started >= 0.5 > plain
