"""A battery of structured-output specs on the tiny random model: JSON schemas written out and drawn by
hypothesis, regexes and choices, under greedy and seeded sampling, n=3, streaming, preemption and a warm
prefix cache. Every token of every output must be one the spec's grammar accepts; an output that stops must
also satisfy the spec itself (jsonschema, re.fullmatch, membership). Extends test_structured.py."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.engines import cpu_engine

MAX_TOKENS = 120
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": 17, "n": 3}

_POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "y": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["x", "y"], "additionalProperties": False}
_NODE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
         "required": ["v", "next"], "additionalProperties": False}

# (id, schema, bounded): every value of a bounded schema has a bounded length, so greedy decoding must
# reach the grammar's end within MAX_TOKENS; unbounded ones may be cut off, which the prefix check covers.
SCHEMAS = [
    ("nested-three-deep", {"type": "object", "properties": {"outer": {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"leaf": {"type": "boolean"}}, "required": ["leaf"],
                  "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False}},
        "required": ["outer"], "additionalProperties": False}, True),
    ("array-of-objects-exactly-two", {"type": "array", "items": _POINT, "minItems": 2, "maxItems": 2}, True),
    ("array-of-arrays", {"type": "array", "items": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 2}, "minItems": 1, "maxItems": 2}, True),
    ("array-of-enums", {"type": "array", "items": {"enum": ["up", "down"]}, "minItems": 1, "maxItems": 4},
     True),
    ("enum-mixed-types", {"enum": [1, "two", None, True, [3]]}, True),
    ("enum-strings-with-escapes", {"enum": ["a b", "c\"d", "e\\f", "ünï"]}, True),
    ("optional-keys", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99}, "label": {"type": "string", "maxLength": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["id"],
        "additionalProperties": False}, True),
    ("no-required-keys", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                          "additionalProperties": False}, True),
    ("negative-integer-range", {"type": "integer", "minimum": -20, "maximum": -3}, True),
    ("number-range", {"type": "number", "minimum": -1.5, "maximum": 2.5}, False),
    ("exclusive-bounds", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}, True),
    ("string-length-range", {"type": "string", "minLength": 3, "maxLength": 5}, True),
    ("string-exact-length", {"type": "string", "minLength": 2, "maxLength": 2}, True),
    ("string-pattern", {"type": "string", "pattern": "^[A-Z][a-z]{2}-[0-9]{2}$"}, True),
    ("anyof-null-or-object", {"anyOf": [{"type": "null"}, _POINT]}, True),
    ("anyof-array-or-boolean", {"anyOf": [{"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                                          {"type": "boolean"}]}, True),
    ("ref-chain", {"$defs": {"point": _POINT, "segment": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"],
        "additionalProperties": False}}, "$ref": "#/$defs/segment"}, True),
    ("ref-recursive-list", {"$defs": {"node": _NODE}, "$ref": "#/$defs/node"}, False),
    ("booleans-in-array", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
     True),
    ("null-valued-key", {"type": "object", "properties": {"nothing": {"type": "null"}, "n": {
        "type": "integer", "minimum": 0, "maximum": 5}}, "required": ["nothing", "n"],
        "additionalProperties": False}, True),
    ("const-object", {"const": {"k": [1, 2], "s": "ok"}}, True),
    ("const-keys-in-object", {"type": "object", "properties": {"version": {"const": 2}, "kind": {
        "const": "point"}, "p": _POINT}, "required": ["version", "kind", "p"], "additionalProperties": False},
     True),
    ("type-list-string-or-null", {"type": ["string", "null"], "maxLength": 2}, True),
    ("tuple-prefix-items", {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                              {"type": "string", "maxLength": 2}],
                            "items": False, "minItems": 2}, True),
    ("free-keys-bounded-values", {"type": "object", "additionalProperties": {
        "type": "integer", "minimum": 0, "maximum": 9}, "maxProperties": 2}, False),
]

BY_NAME = {name: schema for name, schema, _ in SCHEMAS}

REGEXES = [r"(ab|abc|abcd)x?", r"[α-ω]{2,3}", r"\d{3}-\d{4}", r"(yes|no)( please)?", r"[A-F0-9]{8}",
           r"-?(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?"]
CHOICES = [["a", "ab", "abc"], ["日本", "日本語"], [" lead", "trail ", "mid dle"], ['{"x": 1}', "[]"]]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return cpu_engine(tiny_llama_path, num_blocks=128, max_model_len=512)


def _satisfies(spec: dict, text: str) -> None:
    """The whole text of a stopped output meets its spec."""
    (kind, value), = spec.items()
    if kind == "json":
        jsonschema.validate(json.loads(text), value)  # strict json: raw control characters are refused
    elif kind == "regex":
        assert re.fullmatch(value, text), (value, text)
    elif kind == "choice":
        assert text in value, (value, text)


def check_completion(engine, spec: dict, completion) -> bool:
    """Every token is one a fresh matcher of the spec accepts; a stopped output also ends the grammar and
    meets the spec; a cut-off one ends with length. True if it stopped."""
    matcher = engine.structured.matcher(engine.structured.compile(spec))
    for position, token in enumerate(completion.token_ids):
        assert matcher.accept_token(token), (spec, completion.text, position)
    if completion.finish_reason == "length":
        return False
    assert completion.finish_reason == "stop", completion
    assert matcher.is_terminated(), completion
    _satisfies(spec, completion.text)
    return True


def _generate(engine, prompts: str | list[str], spec: dict, **sampling) -> list:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, **sampling, "structured_outputs": spec})
    return engine.generate(prompts, params)


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.mark.parametrize(("schema", "bounded"), [(s, b) for _, s, b in SCHEMAS],
                         ids=[i for i, _, _ in SCHEMAS])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
def test_every_schema_output_is_accepted_and_stopped_ones_validate(engine, schema, bounded, sampling):
    (out,) = _generate(engine, "Answer:", {"json": schema}, **sampling)
    assert len(out.outputs) == sampling.get("n", 1)
    stopped = [check_completion(engine, {"json": schema}, c) for c in out.outputs]
    if bounded and sampling is GREEDY:
        assert all(stopped)


@pytest.mark.parametrize("schema", [s for _, s, _ in SCHEMAS], ids=[i for i, _, _ in SCHEMAS])
def test_an_output_cut_off_by_max_tokens_is_a_prefix_the_grammar_accepts(engine, schema):
    (out,) = _generate(engine, "Answer:", {"json": schema}, temperature=1.0, seed=5, n=3, max_tokens=4)
    for completion in out.outputs:
        check_completion(engine, {"json": schema}, completion)


@pytest.mark.parametrize("pattern", REGEXES)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
def test_regex_outputs_fullmatch(engine, pattern, sampling):
    (out,) = _generate(engine, "Hi", {"regex": pattern}, max_tokens=40, **sampling)
    assert all(check_completion(engine, {"regex": pattern}, c) for c in out.outputs)


@pytest.mark.parametrize("choices", CHOICES, ids=range(len(CHOICES)))
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
def test_choice_outputs_are_one_of_overlapping_or_unicode_choices(engine, choices, sampling):
    (out,) = _generate(engine, "Hi", {"choice": choices}, max_tokens=40, **sampling)
    assert all(check_completion(engine, {"choice": choices}, c) for c in out.outputs)


def test_a_seed_gives_the_same_constrained_outputs_twice(engine):
    spec = {"json": BY_NAME["optional-keys"]}
    first, second = (_generate(engine, "Answer:", spec, **SAMPLED) for _ in range(2))
    assert _tokens(first) == _tokens(second)


STREAM_SPECS = [{"json": BY_NAME["ref-chain"]}, {"json": BY_NAME["ref-recursive-list"]},
                {"regex": REGEXES[5]}, {"choice": CHOICES[0]}]


@pytest.mark.parametrize("spec", STREAM_SPECS, ids=["json-ref-chain", "json-recursive", "regex", "choice"])
def test_streamed_deltas_of_n3_concatenate_to_the_final_valid_text(engine, spec):
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec, **SAMPLED)
    texts: dict[int, str] = defaultdict(str)
    last = None
    for last in engine.stream("Answer:", params):
        for completion in last.outputs:
            texts[completion.index] += completion.text_delta
    assert last is not None and last.finished and len(last.outputs) == 3
    for completion in last.outputs:
        assert texts[completion.index] == completion.text
        check_completion(engine, spec, completion)
    assert _tokens([last]) == _tokens(engine.generate("Answer:", params))


MIXED_SPECS = [({"json": BY_NAME["array-of-objects-exactly-two"]}, GREEDY),
               ({"json": BY_NAME["ref-chain"]}, SAMPLED),
               ({"regex": REGEXES[3]}, {"temperature": 1.0, "seed": 4, "n": 2}),
               ({"choice": CHOICES[2]}, GREEDY)]


def test_preemption_leaves_constrained_outputs_as_without_it(engine, tiny_llama_path):
    # Ten blocks of 16 cannot hold these groups together: sequences are preempted and recomputed with their
    # grammars half done, and must come back to the same tokens (greedy and seeded alike).
    tight = cpu_engine(tiny_llama_path, num_blocks=10, block_size=16, max_model_len=512)
    prompts = [f"Request {i}:" for i in range(len(MIXED_SPECS) * 2)]
    params = [SamplingParams(max_tokens=100, structured_outputs=spec, **sampling)
              for spec, sampling in MIXED_SPECS * 2]
    roomy = engine.generate(prompts, params)
    squeezed = tight.generate(prompts, params)
    assert tight.get_stats().num_preemptions > 0
    assert _tokens(squeezed) == _tokens(roomy)
    for out, param in zip(squeezed, params, strict=True):
        for completion in out.outputs:
            check_completion(tight, param.structured_outputs, completion)


def test_unconstrained_sampled_neighbours_and_constrained_greedy_ones_are_as_when_alone(engine):
    plain = SamplingParams(temperature=0.8, seed=21, n=2, max_tokens=20, ignore_eos=True)
    params = [plain] + [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec, **sampling)
                        for spec, sampling in MIXED_SPECS]
    prompts = ["Once upon a time"] + [f"Reply {i}:" for i in range(len(MIXED_SPECS))]
    alone = [engine.generate(prompt, param)[0] for prompt, param in zip(prompts, params, strict=True)]
    mixed = engine.generate(prompts, params)
    assert _tokens(mixed) == _tokens(alone)
    for out, param in zip(mixed[1:], params[1:], strict=True):
        for completion in out.outputs:
            check_completion(engine, param.structured_outputs, completion)


# About 60 tokens of the tiny tokenizer: several full blocks that a second request can take from the cache.
LONG_PREFIX = "Context for the battery: " + " ".join(f"fact {i} is {i * 7 % 10}." for i in range(12))


def test_a_warm_prefix_cache_keeps_outputs_valid_and_greedy_equal_to_cold(engine):
    spec = {"json": BY_NAME["const-keys-in-object"]}
    hits = engine.get_stats().prefix_cache_hits
    (cold,) = _generate(engine, LONG_PREFIX + " Q0:", spec, **GREEDY)
    (warm,) = _generate(engine, LONG_PREFIX + " Q0:", spec, **GREEDY)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0
    assert engine.get_stats().prefix_cache_hits > hits
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert check_completion(engine, spec, warm.outputs[0])
    hits = engine.get_stats().prefix_cache_hits
    shared = _generate(engine, [LONG_PREFIX + f" Q{i}:" for i in range(1, 4)], spec, **SAMPLED)
    assert engine.get_stats().prefix_cache_hits > hits
    for out in shared:
        assert out.num_cached_tokens > 0
        for completion in out.outputs:
            check_completion(engine, spec, completion)


def test_chunked_prefill_leaves_constrained_outputs_as_in_one_chunk(engine, tiny_llama_path):
    # A 32-token budget splits each ~220-token prompt over several steps before its first grammar-masked one.
    chunked = cpu_engine(tiny_llama_path, num_blocks=128, max_model_len=512, max_num_batched_tokens=32,
                         max_num_seqs=4)
    prompt = LONG_PREFIX + " " + LONG_PREFIX
    params = [SamplingParams(max_tokens=60, structured_outputs=spec, **sampling)
              for spec, sampling in MIXED_SPECS]
    prompts = [f"{prompt} Q{i}:" for i in range(len(params))]
    assert len(engine.tokenizer.encode(prompts[0])) > 4 * 32
    whole, split = engine.generate(prompts, params), chunked.generate(prompts, params)
    assert _tokens(split) == _tokens(whole)
    for out, param in zip(split, params, strict=True):
        for completion in out.outputs:
            check_completion(chunked, param.structured_outputs, completion)


# --------------------------------------------------------------------------- schemas drawn by hypothesis

_KEYS = st.sampled_from(["a", "b", "id", "name", "x_1", "ünï"])
_SCALARS = st.one_of(st.integers(-9, 99), st.sampled_from(["x", "yes", "a b", 'q"t']), st.booleans(),
                     st.none())
_LEAVES = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 30)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(-5, 5), st.integers(1, 10)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(0, 3), st.integers(0, 4)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.sampled_from(["^[a-z]{1,3}$", "^[0-9]{2}-[A-F]$", "^(yes|no)$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(_SCALARS, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    _SCALARS.map(lambda v: {"const": v}),
)


def _object(properties: dict, required: set) -> dict:
    return {"type": "object", "properties": properties, "required": sorted(required),
            "additionalProperties": False}


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    objects = st.dictionaries(_KEYS, children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(lambda required: _object(props, required)))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    any_ofs = st.lists(children, min_size=2, max_size=3).map(lambda branches: {"anyOf": branches})
    return st.one_of(objects, arrays, any_ofs)


_TREES = st.recursive(_LEAVES, _extend, max_leaves=6)
# The same subschema reached through $ref from two places, next to another tree.
_WITH_REFS = st.tuples(_TREES, _TREES).map(lambda t: {
    "$defs": {"item": t[0]}, **_object({"first": {"$ref": "#/$defs/item"}, "other": t[1], "more": {
        "type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}}, {"first", "other"})})
DRAWN_SCHEMAS = st.one_of(_TREES, _WITH_REFS)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=DRAWN_SCHEMAS)
def test_drawn_schemas_give_accepted_outputs_that_validate_when_stopped(engine, schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    spec = {"json": schema}
    params = [SamplingParams(max_tokens=96, structured_outputs=spec, **sampling) for sampling in
              (GREEDY, {"temperature": 1.0, "seed": 3, "n": 2})]
    for out in engine.generate(["Answer:", "Answer:"], params):
        for completion in out.outputs:
            check_completion(engine, spec, completion)


# --------------------------------------------------------------------------- keywords the grammar ignores

# xgrammar 0.2.8 compiles these but ignores the keyword (it logs a warning, or nothing), so outputs that
# stop would break the schema: the engine refuses such a schema naming structured_outputs, as vLLM's
# xgrammar backend does.
UNENFORCED = [
    ("allOf-several", {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 4}]}),
    ("contains", {"type": "array", "contains": {"const": 7},
                  "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2},
                     "uniqueItems": True, "minItems": 3, "maxItems": 3}),
    ("number-multipleOf", {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3}),
    ("not", {"type": "integer", "not": {"const": 0}, "minimum": 0, "maximum": 2}),
    ("if-then", {"type": "integer", "if": {"minimum": 1}, "then": {"maximum": 1}}),
    ("dependentRequired-nested", {"type": "object", "properties": {"o": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}}}),
]


@pytest.mark.parametrize("schema", [s for _, s in UNENFORCED], ids=[i for i, _ in UNENFORCED])
def test_a_schema_keyword_the_grammar_cannot_enforce_is_refused_naming_it(engine, schema):
    with pytest.raises(InvalidRequestError, match="which structured outputs cannot enforce") as info:
        _generate(engine, "Answer:", {"json": schema}, temperature=1.0, seed=5, n=6, max_tokens=80)
    assert info.value.field == "structured_outputs"
    assert not engine.has_unfinished_requests()


def test_the_keywords_the_grammar_enforces_pass_the_check(engine):
    integer_steps = {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20}
    single_all_of = {"allOf": [{"type": "integer", "minimum": 0, "maximum": 4}]}
    for schema in (integer_steps, single_all_of, {"type": "array", "uniqueItems": False, "maxItems": 2}):
        (out,) = _generate(engine, "Answer:", {"json": schema}, temperature=1.0, seed=5, n=4, max_tokens=40)
        for completion in out.outputs:
            check_completion(engine, {"json": schema}, completion)


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 1.0, "seed": 2}], ids=["greedy", "sampled"])
def test_constraints_that_leave_no_token_harm_no_neighbour_and_never_stop_off_grammar(engine, sampling):
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = engine.generate("Once upon a time", plain)[0].outputs[0].token_ids
    spec = {"regex": "[ab]+"}
    # "x" is outside the grammar, so the intersection of the two masks is empty on the first step.
    outside = engine.tokenizer.encode("x", add_special_tokens=False)
    clash = SamplingParams(max_tokens=10, allowed_token_ids=outside, structured_outputs=spec, **sampling)
    neighbour, clashing = engine.generate(["Once upon a time", "Answer:"], [plain, clash])
    assert neighbour.outputs[0].token_ids == alone, neighbour.error
    # The grammar wins over allowed_token_ids where they leave no token in common.
    assert clashing.error is None and clashing.outputs[0].text
    check_completion(engine, spec, clashing.outputs[0])
