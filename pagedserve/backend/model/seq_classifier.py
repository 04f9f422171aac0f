"""Decoder sequence classifiers and rerankers (`Qwen3ForSequenceClassification`, `Qwen2...`, `Llama...`): the
causal decoder whose last token's hidden state goes through `score` (no bias) onto the labels, no lm_head.

A causal LM served as a reranker by its next-token logits (Qwen3-Reranker, vLLM's hf_overrides
`classifier_from_token` with `is_original_qwen3_reranker`): its config.json names the architecture
`Qwen3ForSequenceClassification` and the tokens; its head is the lm_head's rows of those tokens (their logits), or
for the original Qwen3-Reranker the one row yes - no, whose sigmoid is the softmax over (no, yes) at "yes"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.qwen3 import Qwen3ArchConfig, Qwen3ForCausalLM


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    labels = raw.get("id2label") or {"0": "LABEL_0"}
    return tuple(str(labels[k]) for k in sorted(labels, key=int))


@dataclass
class ClassifierArchConfig(ModelArchConfig):
    """A decoder classifier's config.json: its labels; it has no lm_head to tie."""

    id2label: tuple[str, ...] = ()

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super()._fields(arch.replace("ForSequenceClassification", "ForCausalLM"), raw)
        return {**fields, "architecture": arch, "tie_word_embeddings": False, "id2label": _labels(raw)}


@dataclass
class Qwen3ClassifierArchConfig(Qwen3ArchConfig):
    """Qwen3's config.json with a classifier's labels, or the tokens whose logits score (the checkpoint is then a
    causal LM's: its lm_head, tied or not, is read)."""

    id2label: tuple[str, ...] = ()
    classifier_from_token: tuple[str, ...] = ()
    two_way_softmax: bool = False  # one label: logit(tokens[1]) - logit(tokens[0])

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super()._fields(arch, raw)
        tokens = tuple(str(t) for t in raw.get("classifier_from_token") or ())
        if not tokens:
            return {**fields, "tie_word_embeddings": False, "id2label": _labels(raw)}
        two_way = bool(raw.get("is_original_qwen3_reranker", False))
        if two_way and len(tokens) != 2:
            raise UnsupportedModelError("is_original_qwen3_reranker needs classifier_from_token to name two tokens "
                                        f"(no, yes); it names {list(tokens)}")
        labels = ("LABEL_0",) if two_way else tokens
        return {**fields, "id2label": labels, "classifier_from_token": tokens, "two_way_softmax": two_way}


class _ScoreHead:
    """Mixin before a causal LM class: `score` replaces the lm_head; the last token is what it pools."""

    default_pooling = "lasttoken"

    def __init__(self, cfg: Any, max_position: int):
        super().__init__(cfg, max_position)
        del self.lm_head
        self.pooling_head = nn.Linear(cfg.hidden_size, len(cfg.id2label), bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, 0]
        """A classifier samples nothing."""
        return hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)


class TokenLogitHead(nn.Module):
    """The classifier of a causal LM scored by tokens' logits: [N, H] last-token rows -> [N, labels] in fp32. Its
    rows are the lm_head's, taken once the tokenizer has named the tokens (`bind`)."""

    def __init__(self, hidden_size: int, num_tokens: int, two_way: bool):
        super().__init__()
        self.two_way = two_way
        self.register_buffer("weight", torch.zeros(1 if two_way else num_tokens, hidden_size), persistent=False)

    def bind(self, lm_head: torch.Tensor, token_ids: list[int]) -> None:
        """Take the tokens' rows of the lm_head [V, H] (the two-way row: the second's minus the first's)."""
        rows = lm_head[token_ids].float()
        self.weight = (rows[1:] - rows[:1]) if self.two_way else rows

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.float() @ self.weight.t()


class _VocabRows(nn.Module):
    """The lm_head's table [V, H], loaded only for its rows (no nn.Linear: the CPU path leaves it unpacked)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)


class Qwen3TokenScorer(Qwen3ForCausalLM):
    """Qwen3 served as a reranker by its next-token logits: the lm_head is loaded (tied or not) and gives its
    tokens' rows to the head when the pooler binds them, then is dropped."""

    default_pooling = "lasttoken"

    def __init__(self, cfg: Qwen3ClassifierArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.lm_head = _VocabRows(cfg.vocab_size, cfg.hidden_size)
        self.pooling_head = TokenLogitHead(cfg.hidden_size, len(cfg.classifier_from_token), cfg.two_way_softmax)

    def bind_score_tokens(self, token_ids: list[int]) -> None:
        """The head takes the tokens' rows; the lm_head is no longer needed."""
        if self.lm_head.weight.shape[0] != self.config.vocab_size:  # a tensor-parallel rank's vocabulary shard
            raise UnsupportedModelError("a reranker scored by token logits (classifier_from_token) runs on one "
                                        "device; set tensor_parallel_size to 1")
        self.pooling_head.bind(self.lm_head.weight.data, token_ids)
        del self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, 0]
        """A reranker samples nothing."""
        return hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    """Llama / Mistral / Qwen2 with a score head."""


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    """Qwen3 with a score head."""


class ClassifierFamily(ModelFamily):
    """`score.weight` is the head's."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        if name == "score.weight":
            return Placement("pooling_head.weight")
        return super().placement(name, cfg)


class Qwen3Classifier:
    """Builds Qwen3's classifier as its config says: a score head, or the token scorer where it names tokens."""

    def __new__(cls, cfg: Qwen3ClassifierArchConfig, max_position: int) -> nn.Module:  # type: ignore[misc]
        if cfg.classifier_from_token:
            return Qwen3TokenScorer(cfg, max_position)
        return Qwen3ForSequenceClassification(cfg, max_position)


FAMILIES = {
    **{arch: ClassifierFamily(ClassifierArchConfig, LlamaForSequenceClassification) for arch in (
        "LlamaForSequenceClassification", "MistralForSequenceClassification", "Qwen2ForSequenceClassification")},
    "Qwen3ForSequenceClassification": ClassifierFamily(Qwen3ClassifierArchConfig, Qwen3Classifier),
}
