"""A step's pooling rows: which hidden rows each finished pooling request pools, the token types of text pairs
on an encoder, and the pooled vectors (through a classifier's head) that the runner hands back."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagedserve.backend.core.scheduler import ScheduledRequest
from pagedserve.backend.model.config import UnsupportedModelError
from pagedserve.backend.model.loader import load_tokenizer
from pagedserve.backend.model.pooler import PoolingConfig, pool_rows, read_pooling_config

# (request id, first row of its tokens in the step, how many rows): a pooling request whose prompt ends this step.
PoolSpan = tuple[str, int, int]


class StepPooler:
    """Pools the spans of a step's hidden states the model's way: its folder's pooling (sentence-transformers
    files, or the model's default), then a classifier's head onto its labels where the model has one."""

    def __init__(self, model: nn.Module, config: PoolingConfig):
        self.model = model
        self.config = config
        self.head: nn.Module | None = getattr(model, "pooling_head", None)

    @classmethod
    def for_model(cls, model: nn.Module, path: str | Path) -> StepPooler:
        """The pooler of the model loaded from `path` (a classifier pools as its head expects)."""
        default = getattr(model, "default_pooling", "lasttoken")
        if hasattr(model, "bind_score_tokens"):
            model.bind_score_tokens(_score_token_ids(model.config.classifier_from_token, path))
        if getattr(model, "pooling_head", None) is not None or str(path).endswith(".gguf"):
            return cls(model, PoolingConfig(default, False))
        return cls(model, read_pooling_config(path, default, default_normalize=True))

    def pool(self, hidden: torch.Tensor, spans: list[PoolSpan]) -> dict[str, torch.Tensor]:
        """Request id -> its fp32 vector [D] (D: the hidden size, or the number of labels)."""
        if not spans:
            return {}
        ids, starts, lengths = zip(*spans, strict=True)
        vectors = pool_rows(hidden, list(starts), list(lengths), self.config.pooling_type)
        if self.head is not None:
            vectors = self.head(vectors.to(hidden.dtype)).float()
        return dict(zip(ids, vectors.cpu().unbind(0), strict=True))


def _score_token_ids(tokens: tuple[str, ...], path: str | Path) -> list[int]:
    """The vocabulary ids of a token-scoring reranker's tokens (config.json's classifier_from_token)."""
    tokenizer = load_tokenizer(path)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    missing = [t for t, i in zip(tokens, ids, strict=True) if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise UnsupportedModelError(f"classifier_from_token names {missing}, not tokens of this model's vocabulary")
    return ids


def pool_spans(scheduled: list[ScheduledRequest]) -> list[PoolSpan]:
    """The step's pooling requests whose prompt ends in it, with their rows (the step's tokens in order)."""
    spans, offset = [], 0
    for item in scheduled:
        if item.sample and item.request.pooling_params is not None:
            spans.append((item.request.request_id, offset, item.num_scheduled_tokens))
        offset += item.num_scheduled_tokens
    return spans


def token_type_ids(scheduled: list[ScheduledRequest], num_tokens: int) -> torch.Tensor | None:
    """Each step token's type: 1 from a text pair's second segment on (a whole prompt, scheduled from its first
    token), else 0; None when no request in the step is a pair."""
    bounds = [None if s.request.pooling_params is None else s.request.pooling_params.first_segment_tokens
              for s in scheduled]
    if all(b is None for b in bounds):
        return None
    types = torch.zeros(num_tokens, dtype=torch.int64)
    offset = 0
    for item, bound in zip(scheduled, bounds, strict=True):
        if bound is not None:
            types[offset + bound : offset + item.num_scheduled_tokens] = 1
        offset += item.num_scheduled_tokens
    return types
