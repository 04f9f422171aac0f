"""Structured outputs with xgrammar: each distinct spec compiled once per engine, a matcher per sequence, and
one token bitmask per step applied to the rows that have a matcher, before any other logits processing."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.structured.mask import mask_logits
from pagedserve.backend.structured.reasoning import ReasoningGate

MAX_CACHED_GRAMMARS = 256
_JSON_KINDS = ("json", "json_object")
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarState:
    """One sequence's xgrammar matcher, and whether its tokens may hold control bytes: xgrammar 0.2.8 lets
    raw control characters into bounded JSON strings, which JSON forbids (compact JSON needs none)."""

    def __init__(self, matcher: Any, ban_control_bytes: bool):
        self.matcher = matcher
        self.ban_control_bytes = ban_control_bytes

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputs:
    """The engine's grammar compiler and its cache over a Hugging Face `tokenizer`'s vocabulary; xgrammar is
    imported on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._no_control: torch.Tensor | None = None  # a bitmask row allowing all but tokens with a control byte
        self._cache: OrderedDict[str, Future] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _xgr(self) -> Any:
        import xgrammar

        if self._compiler is None:
            with self._load_lock:  # the grammar thread and the engine thread may both come first
                if self._compiler is None:
                    self._load(xgrammar)
        return xgrammar

    def _load(self, xgrammar: Any) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                       stop_token_ids=self._stop_token_ids)
        ids = [i for i, piece in enumerate(info.decoded_vocab)
               if i not in self._stop_token_ids and any(b < 0x20 for b in piece)]
        self._no_control = no_control_words(ids, self._vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info)

    def compile(self, spec: dict) -> tuple[Any, bool]:
        """(compiled grammar, whether it is JSON) of a checked spec (SamplingParams.structured_outputs),
        waiting for it; a spec xgrammar cannot compile is refused naming structured_outputs."""
        return self.compile_async(spec).result()

    def compile_async(self, spec: dict) -> Future:
        """A future of `compile(spec)`: done at once for a cached spec, else compiled on the grammar thread
        (xgrammar releases the GIL while it compiles, so the engine thread steps meanwhile)."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-grammar")
            future = self._pool.submit(self._compile_entry, spec)
            if len(self._cache) >= MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self._cache[key] = future
        return future

    def _compile_entry(self, spec: dict) -> tuple[Any, bool]:
        try:
            return self._compile(spec), next(iter(spec)) in _JSON_KINDS
        except InvalidRequestError:
            raise  # kept in the cache: the same bad spec is refused again at once
        except BaseException:
            with self._lock:  # an unexpected failure is not remembered: the next request tries again
                key = json.dumps(spec, sort_keys=True)
                self._cache.pop(key, None)
            raise

    def _compile(self, spec: dict) -> Any:
        self._xgr()
        (kind, value), = spec.items()
        compiler = self._compiler
        try:
            if kind == "json":
                # Compact JSON: free whitespace lets a weak model loop on newlines until max_tokens.
                return compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                # Each choice as an EBNF string literal; JSON's escapes are the ones EBNF reads.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
            return compiler.compile_grammar(value)
        except Exception as error:  # noqa: BLE001 - xgrammar reports every bad spec as a RuntimeError
            lines = str(error).strip().splitlines()
            # xgrammar prefixes its messages with "[hh:mm:ss] /project/cpp/file.cc:83: ".
            detail = _XGRAMMAR_PREFIX.sub("", lines[-1]) if lines else type(error).__name__
            raise InvalidRequestError(f"structured_outputs.{kind} cannot be compiled: {detail}",
                                      "structured_outputs") from None

    def matcher(self, grammar: tuple[Any, bool]) -> GrammarState:
        """A fresh matcher of a compiled grammar (`compile`'s answer), for one sequence."""
        compiled, is_json = grammar
        return GrammarState(self._xgr().GrammarMatcher(compiled), ban_control_bytes=is_json)

    def sequence_matchers(self, grammar: tuple[Any, bool] | None, end_token_ids: list[int] | None,
                          budget: int | None) -> Callable[[], Any] | None:
        """What makes each sequence's matcher: the grammar's, behind a ReasoningGate when the request names
        its reasoning's end marker; None when neither constrains it."""
        if end_token_ids:
            return lambda: ReasoningGate(end_token_ids, budget, None if grammar is None else self.matcher(grammar))
        return None if grammar is None else (lambda: self.matcher(grammar))

    def apply(self, logits: torch.Tensor, matchers: list[GrammarState | ReasoningGate | None]) -> torch.Tensor:
        """Mask row i of `logits` [R, V] to the tokens matchers[i] allows (rows with None untouched): the
        matchers fill one host bitmask, which goes to the logits' device in one copy."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return logits
        xgr = self._xgr()
        logits = logits.float()  # what the sampler reads anyway; the CPU kernel takes fp32 only
        bitmask = xgr.allocate_token_bitmask(len(rows), self._vocab_size)
        json_rows = []
        for k, i in enumerate(rows):
            matchers[i].matcher.fill_next_token_bitmask(bitmask, k)
            if matchers[i].ban_control_bytes:
                json_rows.append(k)
        if json_rows:
            bitmask[json_rows] &= self._no_control
        mask_logits(logits, bitmask, rows)
        return logits


def no_control_words(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row [ceil(V / 32)] int32 with every bit set but those of `token_ids`."""
    words = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    for token in token_ids:
        words[token // 32] &= ~(1 << (token % 32)) if token % 32 != 31 else 0x7FFFFFFF
    return words
