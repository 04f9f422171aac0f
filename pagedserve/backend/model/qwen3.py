"""Qwen3: Llama's decoder with a per-head RMSNorm on Q and K before the rotary embedding, no QKV bias, and a
head_dim of its own (not hidden_size / num_heads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.family import ModelFamily
from pagedserve.backend.model.llama import Attention, DecoderLayer, HeadNormedAttention, LlamaForCausalLM


@dataclass
class Qwen3ArchConfig(ModelArchConfig):
    """Qwen3's config.json: as Llama's (attention_bias covers q/k/v/o), its window only with use_sliding_window."""

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super()._fields(arch, raw)
        if not raw.get("use_sliding_window", False):
            fields["sliding_window"] = None
        return fields


class Qwen3Attention(HeadNormedAttention, Attention):
    """Attention whose Q and K heads are each RMS-normalised (weights over head_dim) before rotation."""


class Qwen3DecoderLayer(DecoderLayer):
    """Llama's layer with Qwen3's attention."""

    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's model with Qwen3's layers."""

    layer_cls = Qwen3DecoderLayer


FAMILIES = {"Qwen3ForCausalLM": ModelFamily(Qwen3ArchConfig, Qwen3ForCausalLM)}
