"""Structured outputs in the engine (xgrammar): on a random-weight model the grammar does all the work, so
every output that stops must match its spec exactly; unconstrained neighbours are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.structured import no_control_words
from tests.support.engines import cpu_engine

MAX_TOKENS = 160


def _parse(text: str):
    return json.loads(text)  # strict: raw control characters in a string are not JSON


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1}, "y": {"type": "number"}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
     "required": ["id"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"],
                        "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/leaf"}, "b": {"$ref": "#/$defs/leaf"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "maxItems": 2},
                                      "note": {"type": "string", "maxLength": 4}},
     "required": ["tags"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return cpu_engine(tiny_llama_path, num_blocks=128, max_model_len=512)


# Schemas whose every value is bounded: greedy decoding must reach the end of the grammar.
BOUNDED = [0, 1, 2, 3, 4, 7]


def _check(engine, spec: dict, completion, schema: dict | None = None) -> bool:
    """A stopped output matches its spec; a cut-off one is a prefix the grammar accepts. True if stopped."""
    if completion.finish_reason == "length":
        matcher = engine.structured.matcher(engine.structured.compile(spec))
        assert all(matcher.accept_token(t) for t in completion.token_ids), completion.text
        return False
    assert completion.finish_reason == "stop", completion
    if schema is not None:
        jsonschema.validate(_parse(completion.text), schema)
    return True


def _completions(engine, spec: dict, **params) -> list:
    settings = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "structured_outputs": spec, **params}
    return engine.generate("Answer:", SamplingParams(**settings))[0].outputs


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 3}],
                         ids=["greedy", "sampled-n3"])
def test_every_stopped_output_validates_against_its_schema(engine, schema, sampling):
    outputs = _completions(engine, {"json": schema}, **sampling)
    assert len(outputs) == sampling.get("n", 1)
    stopped = [_check(engine, {"json": schema}, completion, schema) for completion in outputs]
    if SCHEMAS.index(schema) in BOUNDED and sampling["temperature"] == 0.0:
        assert all(stopped)


def test_regex_output_matches_the_whole_pattern(engine):
    pattern = r"[a-c]{3,5}-[0-9]{2}"
    for completion in _completions(engine, {"regex": pattern}, temperature=1.0, seed=1, n=3):
        assert completion.finish_reason == "stop" and re.fullmatch(pattern, completion.text), completion.text


def test_choice_output_is_one_of_the_choices(engine):
    choices = ["yes", "no", "maybe so", "it \"depends\""]
    for completion in _completions(engine, {"choice": choices}, temperature=1.0, seed=2, n=3):
        assert completion.finish_reason == "stop" and completion.text in choices


def test_grammar_and_json_object(engine):
    grammar = 'root ::= "(" digit digit? digit? ")" \ndigit ::= [0-9]'
    (completion,) = _completions(engine, {"grammar": grammar})
    assert completion.finish_reason == "stop" and re.fullmatch(r"\([0-9]{1,3}\)", completion.text)
    (completion,) = _completions(engine, {"json_object": True}, max_tokens=400)
    if completion.finish_reason == "stop":
        _parse(completion.text)


def test_a_cut_off_output_ends_with_length_and_streams_the_same_text(engine):
    spec = {"json": {"type": "array", "items": {"type": "string"}, "minItems": 50}}
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec)
    streamed = "".join(out.outputs[0].text_delta for out in engine.stream("Answer:", params))
    (whole,) = engine.generate("Answer:", params)[0].outputs
    assert whole.finish_reason == "length" and whole.text.startswith("[") and streamed == whole.text


def test_constrained_neighbours_leave_unconstrained_tokens_as_when_alone(engine):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = engine.generate("Once upon a time", plain)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMAS[0]})
    mixed = engine.generate(["Answer:", "Once upon a time", "Reply:"], [constrained, plain, constrained])
    assert mixed[1].outputs[0].token_ids == alone
    for out in (mixed[0], mixed[2]):
        jsonschema.validate(_parse(out.outputs[0].text), SCHEMAS[0])


def test_preemption_keeps_every_output_valid(tiny_llama_path):
    # A pool this small preempts and recomputes sequences while their grammars are half done.
    engine = cpu_engine(tiny_llama_path, num_blocks=10, block_size=16, max_model_len=512)
    spec = {"json": SCHEMAS[0]}
    params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=spec)
    outputs = engine.generate([f"Request {i}:" for i in range(6)], params)
    assert engine.get_stats().num_preemptions > 0
    for out in outputs:
        _check(engine, spec, out.outputs[0], SCHEMAS[0])


@pytest.mark.parametrize(("spec", "message"), [
    ({"regex": "[a-"}, "structured_outputs.regex cannot be compiled"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
     "structured_outputs.json cannot be compiled"),
    ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar cannot be compiled"),
    ({"choice": []}, "structured_outputs.choice must be a list"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
])
def test_bad_specs_are_refused_naming_the_field_and_take_no_blocks(engine, spec, message):
    free = engine.get_stats().num_free_blocks
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        engine.add_request("bad", "Hi", SamplingParams(structured_outputs=spec))
    assert info.value.field == "structured_outputs"
    assert engine.get_stats().num_free_blocks == free and not engine.has_unfinished_requests()


def test_beam_search_with_a_spec_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="structured_outputs is not supported with beam search"):
        engine.add_request("beams", "Hi", SamplingParams(beam_width=2, structured_outputs={"regex": "a+"}))


def test_vllm_guided_keys_are_the_same_spec():
    params = SamplingParams.from_dict({"guided_regex": "a+", "max_tokens": "8"})
    assert params.structured_outputs == {"regex": "a+"} and params.max_tokens == 8
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"guided_regex": "a+", "structured_outputs": {"choice": ["x"]}})
    assert info.value.field == "structured_outputs"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_ends_before_min_tokens_ends_the_output_with_stop(engine, temperature):
    params = SamplingParams(temperature=temperature, seed=3, n=3 if temperature else 1, max_tokens=20,
                            min_tokens=6, structured_outputs={"regex": "ab"})
    for completion in engine.generate("Hi", params)[0].outputs:
        assert (completion.text, completion.finish_reason) == ("ab", "stop")
        assert completion.token_ids[-1] in engine.eos_token_ids


def test_min_tokens_still_holds_off_the_end_while_the_grammar_goes_on(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, structured_outputs={"regex": "a+"})
    completion = engine.generate("Hi", params)[0].outputs[0]
    assert re.fullmatch("a+", completion.text) and len(completion.token_ids) >= 5


def test_the_control_byte_row_clears_exactly_the_given_tokens():
    words = no_control_words([0, 31, 32, 70], 71)
    allowed = [t for t in range(71) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert allowed == [t for t in range(71) if t not in (0, 31, 32, 70)]


def test_a_compile_runs_off_the_caller_and_a_cached_spec_is_ready_at_once(engine):
    spec = {"json": {"type": "object", "properties": {"compiled_once": {"type": "integer"}}}}
    first = engine.structured.compile_async(spec)
    first.result(timeout=30)
    again = engine.structured.compile_async(json.loads(json.dumps(spec)))
    assert again is first and again.done()
    bad = engine.structured.compile_async({"regex": "(unclosed"})
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex cannot be compiled"):
        bad.result(timeout=30)
