"""Decoder sequence classifiers and rerankers (`Qwen3ForSequenceClassification`, `Qwen2...`, `Llama...`): the
causal decoder whose last token's hidden state goes through `score` (no bias) onto the labels, no lm_head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig
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
    """Qwen3's config.json with a classifier's labels."""

    id2label: tuple[str, ...] = ()

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super()._fields(arch, raw)
        return {**fields, "tie_word_embeddings": False, "id2label": _labels(raw)}


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


FAMILIES = {
    **{arch: ClassifierFamily(ClassifierArchConfig, LlamaForSequenceClassification) for arch in (
        "LlamaForSequenceClassification", "MistralForSequenceClassification", "Qwen2ForSequenceClassification")},
    "Qwen3ForSequenceClassification": ClassifierFamily(Qwen3ClassifierArchConfig, Qwen3ForSequenceClassification),
}
