"""User-facing sampling parameters with vLLM's names, validated field by field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.logits_params import check_allowed_token_ids, check_bad_words, check_logit_bias
from pagedserve.backend.core.schema_support import unenforceable_keyword

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
# length**length_penalty stays a finite, non-zero float for any length up to 2**20 tokens.
MAX_LENGTH_PENALTY = 50.0


def _fail(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} {message}", name)


def _int(name: str, value: Any, low: int, high: int | None = None, optional: bool = False) -> None:
    """Check an int (bool is not an int) in [low, high]; None passes when optional."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, f"must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _fail(name, f"must be {bound}, got {value}")


def _number(name: str, value: Any) -> float:
    """Check a finite real number (int or float, never bool or str) and return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise _fail(name, f"must be finite, got {value}")
    return float(value)


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(name, f"must be a boolean, got {type(value).__name__}")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; `__post_init__` refuses bad values naming the field."""

    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # One of {"json": schema, "regex": str, "choice": [str], "grammar": EBNF str, "json_object": true}.
    structured_outputs: dict | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens; -1: all that fit
    lora_name: str | None = None  # the LoRA adapter to generate with (the Triton vLLM backend's key); None: base
    # The reasoning's end marker as token ids (the OpenAI shim's reasoning parser sends them): the structured
    # output starts matching after it; thinking_token_budget (vLLM's name) forces it after that many tokens.
    reasoning_end_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    # bad_words as token-id sequences, filled in by the engine from its tokenizer.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The engine's id of lora_name's adapter as loaded now (0: none), filled in by the engine.
    lora_int_id: int = 0

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_probabilities()
        self._check_lengths()
        self._check_stops()
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.allowed_token_ids = check_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = check_bad_words(self.bad_words)
        if self.truncate_prompt_tokens != -1:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, optional=True)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _bool(name, getattr(self, name))
        _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, optional=True)
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise _fail("lora_name", f"must be a non-empty string, got {self.lora_name!r}")
        self._check_reasoning()

    def _check_reasoning(self) -> None:
        ids = self.reasoning_end_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise _fail("reasoning_end_token_ids", f"must be a non-empty list of token ids, got {ids!r}")
        self.reasoning_end_token_ids = None if ids is None else list(ids)
        _int("thinking_token_budget", self.thinking_token_budget, 0, optional=True)
        if self.thinking_token_budget is not None and ids is None:
            raise _fail("thinking_token_budget", "needs reasoning_end_token_ids (the end marker it forces; the "
                        "OpenAI shim sends it when started with --reasoning-parser)")

    def _check_counts(self) -> None:
        _int("n", self.n, 1, MAX_N)
        _int("beam_width", self.beam_width, 1, MAX_N)
        if self.beam_width > 1 and self.n > self.beam_width:
            raise _fail("n", f"must be <= beam_width ({self.beam_width}) with beam search, got {self.n}")
        self.length_penalty = _number("length_penalty", self.length_penalty)
        if abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise _fail("length_penalty", f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                                          f"got {self.length_penalty}")
        _int("seed", self.seed, 0, MAX_SEED, optional=True)

    def _check_probabilities(self) -> None:
        self.temperature = _number("temperature", self.temperature)
        if self.temperature < 0:
            raise _fail("temperature", f"must be >= 0, got {self.temperature}")
        _int("top_k", self.top_k, -1)
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise _fail(name, f"must be in [-2, 2], got {value}")
            setattr(self, name, value)

    def _check_lengths(self) -> None:
        _int("max_tokens", self.max_tokens, 1, optional=True)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    def _check_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise _fail("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _fail("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise _fail(
                    "stop", f"entries must be strings of 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}"
                )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise _fail(
                "stop_token_ids", f"must be a list of integers, got {type(self.stop_token_ids).__name__}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise _fail("stop_token_ids", f"entries must be integers >= 0, got {tok!r}")

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: Any) -> SamplingParams:
        """Build from a JSON object, refusing a non-dict, unknown keys and wrong types by name."""
        if not isinstance(d, dict):
            raise InvalidRequestError(
                f"sampling_parameters must be a JSON object, got {type(d).__name__}", "sampling_parameters"
            )
        d = _with_guided_keys(d)
        known = {name: kind for name, kind in _FIELD_TYPES.items() if name not in _ENGINE_FILLED}
        for key in d:
            if key not in known:
                raise InvalidRequestError(
                    f"unknown sampling parameter {key!r}; allowed: {', '.join(sorted(known))}", str(key)
                )
        return cls(**{key: _from_string(key, value) for key, value in d.items()})


_FIELD_TYPES = {f.name: f.type for f in fields(SamplingParams)}
_ENGINE_FILLED = frozenset({"bad_words_token_ids", "lora_int_id"})  # not request fields
_TRUE_WORDS = frozenset({"true", "1", "yes", "y", "on", "t"})
_FALSE_WORDS = frozenset({"false", "0", "no", "n", "off", "f"})


def _from_string(name: str, value: Any) -> Any:
    """A string value converted by the field's type, as Triton's vLLM backend does (genai-perf sends
    `"max_tokens": "32"`); other values and string-typed fields pass through to the field checks."""
    if not isinstance(value, str):
        return value
    kind = _FIELD_TYPES[name].replace(" | None", "")
    text = value.strip()
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise _fail(name, f"must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}") from None
    if kind == "bool":
        if text.lower() in _TRUE_WORDS:
            return True
        if text.lower() in _FALSE_WORDS:
            return False
        raise _fail(name, f"must be a boolean (true or false), got {value!r}")
    return value


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's older request keys for the same specs.
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
MAX_CHOICES = 256


def _with_guided_keys(d: dict) -> dict:
    """`guided_json` and its siblings folded into `structured_outputs` (two specs at once are refused)."""
    guided = {key: d[key] for key in _GUIDED_KEYS if key in d}
    if not guided:
        return d
    if len(guided) > 1 or d.get("structured_outputs") is not None:
        names = sorted(guided) + (["structured_outputs"] if d.get("structured_outputs") is not None else [])
        raise _fail(names[-1], f"is one of several output constraints ({', '.join(names)}); give one")
    (key, value), = guided.items()
    rest = {k: v for k, v in d.items() if k != key}
    return {**rest, "structured_outputs": {_GUIDED_KEYS[key]: value}}


def _structured_outputs(spec: Any) -> dict | None:
    """A checked structured-output spec: exactly one kind, of the right type; a JSON string is parsed."""
    name = "structured_outputs"
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = _parse_json(name, spec)
    if not isinstance(spec, dict):
        raise _fail(name, f"must be an object with one of {', '.join(STRUCTURED_KINDS)}, got {type(spec).__name__}")
    given = [key for key, value in spec.items() if value is not None and value is not False]
    unknown = [key for key in spec if key not in STRUCTURED_KINDS]
    if unknown:
        raise _fail(name, f"has unknown key {unknown[0]!r}; allowed: {', '.join(STRUCTURED_KINDS)}")
    if len(given) != 1:
        raise _fail(name, f"must give exactly one of {', '.join(STRUCTURED_KINDS)}, got {len(given)}")
    kind = given[0]
    return {kind: _structured_value(kind, spec[kind])}


def _parse_json(name: str, text: str) -> Any:
    """`text` parsed as JSON; refused naming structured_outputs (where every spec error is reported)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"{name} is not valid JSON: {error}", "structured_outputs") from None


def _structured_value(kind: str, value: Any) -> Any:
    name = f"structured_outputs.{kind}"

    def refuse(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{name} {message}", "structured_outputs")

    if kind == "json":
        if isinstance(value, str):
            value = _parse_json(name, value)
        if not isinstance(value, (dict, bool)):
            raise refuse(f"must be a JSON Schema object, got {type(value).__name__}")
        unenforceable = unenforceable_keyword(value)
        if unenforceable:
            raise refuse(f"uses {unenforceable}, which structured outputs cannot enforce")
        return value
    if kind == "json_object":
        if value is not True:
            raise refuse(f"must be true, got {value!r}")
        return True
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise refuse(f"must be a list of 1..{MAX_CHOICES} non-empty strings, got {value!r}")
        return list(value)
    if not isinstance(value, str) or not value:
        raise refuse(f"must be a non-empty string, got {value!r}")
    return value
