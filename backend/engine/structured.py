"""Structured outputs with xgrammar: each distinct spec compiled once per engine, a matcher per sequence, and
one token bitmask per step applied to the rows that have a matcher, before any other logits processing."""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.engine.detokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256
_JSON_KINDS = ("json", "json_object")


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
    """The engine's grammar compiler and its cache; xgrammar is imported on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._control_tokens: torch.Tensor | None = None  # ids whose bytes include one below 0x20
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _xgr(self) -> Any:
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                           stop_token_ids=self._stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
            ids = [i for i, piece in enumerate(info.decoded_vocab)
                   if i not in self._stop_token_ids and any(b < 0x20 for b in piece)]
            self._control_tokens = torch.tensor(ids, dtype=torch.long)
        return xgrammar

    def compile(self, spec: dict) -> tuple[Any, bool]:
        """(compiled grammar, whether it is JSON) of a checked spec (SamplingParams.structured_outputs); a
        spec xgrammar cannot compile is refused naming structured_outputs."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(spec)
                if len(self._cache) >= MAX_CACHED_GRAMMARS:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = compiled
            return compiled, next(iter(spec)) in _JSON_KINDS

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
            detail = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise InvalidRequestError(f"structured_outputs.{kind} cannot be compiled: {detail}",
                                      "structured_outputs") from None

    def matcher(self, grammar: tuple[Any, bool]) -> GrammarState:
        """A fresh matcher of a compiled grammar (`compile`'s answer), for one sequence."""
        compiled, is_json = grammar
        return GrammarState(self._xgr().GrammarMatcher(compiled), ban_control_bytes=is_json)

    def apply(self, logits: torch.Tensor, matchers: list[GrammarState | None]) -> torch.Tensor:
        """Mask row i of `logits` [R, V] to the tokens matchers[i] allows (rows with None untouched)."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return logits
        xgr = self._xgr()
        if logits.dtype != torch.float32:
            logits = logits.float()
        bitmask = xgr.allocate_token_bitmask(len(matchers), self._vocab_size)
        for i in rows:
            matchers[i].matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self._vocab_size,
                                        indices=rows)
        banned = [i for i in rows if matchers[i].ban_control_bytes]
        if banned and self._control_tokens.numel():
            with torch.inference_mode():  # the runner's logits are inference tensors
                rows_t = torch.tensor(banned, device=logits.device)[:, None]
                logits[rows_t, self._control_tokens.to(logits.device)[None, :]] = -float("inf")
        return logits
