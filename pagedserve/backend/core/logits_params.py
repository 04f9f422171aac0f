"""The sampling fields that edit logits directly (vLLM's names): logit_bias, allowed_token_ids, bad_words;
each checked and normalised, refused naming the field."""

from __future__ import annotations

import math
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound
MAX_BIASED_TOKENS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


def _fail(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} {message}", name)


def _token_id(name: str, value: Any) -> int:
    """A token id as an int; JSON object keys arrive as digit strings (OpenAI's logit_bias)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(name, f"token ids must be integers >= 0, got {value!r}")
    return value


def check_logit_bias(value: Any) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]}; None or {} for none."""
    name = "logit_bias"
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise _fail(name, f"must be an object of token id to bias, got {type(value).__name__}")
    if len(value) > MAX_BIASED_TOKENS:
        raise _fail(name, f"may bias at most {MAX_BIASED_TOKENS} tokens, got {len(value)}")
    biases = {}
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise _fail(name, f"biases must be numbers, got {bias!r} for token {key!r}")
        if abs(bias) > MAX_LOGIT_BIAS:
            raise _fail(name, f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        biases[_token_id(name, key)] = float(bias)
    return biases


def check_allowed_token_ids(value: Any) -> list[int] | None:
    """A non-empty list of token ids the output is drawn from; None for all."""
    name = "allowed_token_ids"
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise _fail(name, f"must be a non-empty list of token ids, got {value!r}")
    return sorted({_token_id(name, token) for token in value})


def check_bad_words(value: Any) -> list[str]:
    """Words the output never contains (each as the model would tokenize it, with or without a leading
    space); [] for none."""
    name = "bad_words"
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_BAD_WORDS:
        raise _fail(name, f"must be a list of at most {MAX_BAD_WORDS} strings, got {value!r}")
    for word in value:
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise _fail(name, f"entries must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters, "
                              f"got {word!r}")
    return list(value)


def check_token_ids_in_vocab(name: str, token_ids: Any, vocab_size: int) -> None:
    """Refuse a token id the model does not have."""
    for token in token_ids or ():
        if token >= vocab_size:
            raise _fail(name, f"token ids must be < the vocabulary size ({vocab_size}), got {token}")
