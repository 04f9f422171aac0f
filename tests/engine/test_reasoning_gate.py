"""Constraints after thinking in the engine: with `reasoning_end_token_ids`, a sequence samples freely until
the end marker is generated and its grammar matches only the answer after it; `thinking_token_budget` forces
the marker once that many tokens were thought. On a random-weight model the forced marker and the grammar do
all the work, so the thinking is the free run's tokens and the answer validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.engines import cpu_engine

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
END = "</think>"


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return cpu_engine(tiny_llama_path, num_blocks=128, max_model_len=512)


@pytest.fixture(scope="module")
def end_ids(engine) -> list[int]:
    return engine.tokenizer.encode(END, add_special_tokens=False)


def _run(engine, **settings):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 80, **settings})
    return engine.generate("Think:", params)[0].outputs[0]


def test_budget_forces_the_marker_then_the_grammar_holds_the_answer(engine, end_ids) -> None:
    free = _run(engine, ignore_eos=True)
    out = _run(engine, reasoning_end_token_ids=end_ids, thinking_token_budget=6,
               structured_outputs={"json": SCHEMA})
    assert len(end_ids) > 1  # the tiny tokenizer writes the marker in several tokens: each one is forced
    assert out.token_ids[:6] == free.token_ids[:6]  # the thinking is unconstrained
    assert out.token_ids[6:6 + len(end_ids)] == end_ids
    assert out.finish_reason == "stop"
    thinking, answer = out.text.split(END, 1)
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_no_marker_no_constraint(engine, end_ids) -> None:
    """Without the marker (this model never writes it) the grammar never starts: the output is the free one."""
    free = _run(engine, ignore_eos=True, max_tokens=30)
    gated = _run(engine, ignore_eos=True, max_tokens=30, reasoning_end_token_ids=end_ids,
                 structured_outputs={"json": SCHEMA})
    assert gated.token_ids == free.token_ids


def test_budget_zero_and_no_grammar(engine, end_ids) -> None:
    out = _run(engine, ignore_eos=True, max_tokens=20, reasoning_end_token_ids=end_ids, thinking_token_budget=0)
    assert out.token_ids[:len(end_ids)] == end_ids and out.text.startswith(END)
    assert len(out.token_ids) == 20


def test_each_sequence_has_its_own_gate(engine, end_ids) -> None:
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=80, reasoning_end_token_ids=end_ids,
                            thinking_token_budget=4, structured_outputs={"json": SCHEMA})
    for completion in engine.generate("Think:", params)[0].outputs:
        assert completion.token_ids[4:4 + len(end_ids)] == end_ids
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text.split(END, 1)[1]), SCHEMA)


@pytest.mark.parametrize(("settings", "field"), [
    ({"thinking_token_budget": 4}, "thinking_token_budget"),
    ({"reasoning_end_token_ids": [], "thinking_token_budget": 4}, "reasoning_end_token_ids"),
    ({"reasoning_end_token_ids": [1], "thinking_token_budget": -1}, "thinking_token_budget"),
    ({"reasoning_end_token_ids": ["a"]}, "reasoning_end_token_ids"),
])
def test_bad_reasoning_fields_are_refused(settings, field) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**settings)
    assert info.value.field == field


def test_end_marker_outside_the_vocabulary_is_refused(engine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("x", SamplingParams(max_tokens=2, reasoning_end_token_ids=[10**6]))
    assert info.value.field == "reasoning_end_token_ids"


@pytest.mark.slow
def test_drafts_verified_through_the_gate_give_the_same_tokens(tiny_llama_path, engine, end_ids) -> None:
    """n-gram drafts are masked and rolled back through the gate (thinking, forced marker, grammar)."""
    from tests.support.speculation import PROMPTS, run, spec

    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, reasoning_end_token_ids=end_ids,
                            thinking_token_budget=10, structured_outputs={"json": SCHEMA})
    plain = run(cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256), PROMPTS, params)
    drafted_engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=256,
                                speculative_config=spec(3))
    drafted = run(drafted_engine, PROMPTS, params)
    assert drafted_engine.get_stats().spec_decode_num_drafts > 0
    for key, completion in plain.items():
        assert drafted[key].token_ids == completion.token_ids
        assert completion.token_ids[10:10 + len(end_ids)] == end_ids
