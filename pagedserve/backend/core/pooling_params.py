"""A pooling request's parameters (vLLM's PoolingParams): which task, and how its vector is finished. A pooling
request is prefill only: its prompt's hidden states are pooled once computed and its blocks freed at once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError, json_object

# embed: a vector; classify: the class probabilities; score: a cross-encoder's relevance of a text pair.
POOLING_TASKS = ("embed", "classify", "score")


@dataclass(slots=True)
class PoolingParams:
    """`normalize` (embed; None: as the model's folder says), `dimensions` (embed: a Matryoshka model's
    leading dimensions), `activation` (classify / score: softmax or sigmoid as the model's config says; false:
    the raw logits), `prompt_name` (embed: the model folder's named instruction prompt put before a text input, as
    sentence-transformers' encode(prompt_name=...); None: its default prompt, if it names one). `first_segment_tokens`, set by the engine for a text pair, is how many leading prompt tokens
    are token type 0 (the rest type 1, on a model with token types)."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool = True
    prompt_name: str | None = None
    first_segment_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {POOLING_TASKS}, got {self.task!r}", "task")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a bool, got {value!r}", name)
        if self.prompt_name is not None and (not isinstance(self.prompt_name, str) or self.task != "embed"):
            raise InvalidRequestError(f"prompt_name must be a string, for task 'embed'; got {self.prompt_name!r}",
                                      "prompt_name")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise InvalidRequestError(f"dimensions must be an integer >= 1, got {self.dimensions!r}", "dimensions")
            if self.task != "embed":
                raise InvalidRequestError(f"dimensions applies to task 'embed', not {self.task!r}", "dimensions")

    @classmethod
    def from_dict(cls, value: object, field_name: str = "pooling_params") -> PoolingParams:
        """From a dict with these keys, or its JSON text (the llm model's `pooling_params`); unknown keys refused."""
        raw: dict[str, Any] = json_object(value, field_name, InvalidRequestError) if value not in (None, "") else {}
        known = {f.name for f in fields(cls)} - {"first_segment_tokens"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"unknown {field_name} field {unknown[0]!r}; known: {sorted(known)}",
                                      f"{field_name}.{unknown[0]}")
        return cls(**raw)
