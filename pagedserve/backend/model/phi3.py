"""Phi-3 / Phi-4: Llama's decoder whose checkpoints store qkv_proj and gate_up_proj already fused, with LongRoPE
(`longrope`, formerly `su`) scaling and, where `partial_rotary_factor` < 1, rotary on the first dims only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve import kernels
from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily
from pagedserve.backend.model.llama import Attention, DecoderLayer, LlamaForCausalLM


@dataclass
class Phi3ArchConfig(ModelArchConfig):
    """Phi-3's config.json: LongRoPE's factors completed from the top-level keys, and the rotary dimension."""

    ROPE_TYPES = ("default", "longrope")

    rotary_dim: int = 0

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        raw = _su_as_longrope(raw)
        fields = super()._fields(arch, raw)
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(fields["head_dim"] * factor)
        if not 0 < rotary_dim <= fields["head_dim"] or rotary_dim % 2:
            raise UnsupportedModelError(f"partial_rotary_factor {factor} gives a rotary dimension of {rotary_dim} "
                                        f"for head_dim {fields['head_dim']}; it must be even and in 2..head_dim")
        fields["rotary_dim"] = rotary_dim
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = _longrope_scaling(fields["rope_scaling"], raw)
        return fields


def _su_as_longrope(raw: dict[str, Any]) -> dict[str, Any]:
    """Early Phi-3 configs name LongRoPE `su`."""
    raw = dict(raw)
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params and (params.get("rope_type") or params.get("type")) == "su":
            raw[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "longrope"}
    return raw


def _longrope_scaling(scaling: dict, raw: dict[str, Any]) -> dict:
    """The scaling dict with original_max_position_embeddings and attention_factor filled in as transformers
    does: the factor max_position_embeddings / original unless given, sqrt(1 + ln(factor) / ln(original))."""
    scaling = dict(scaling)
    scaling.pop("partial_rotary_factor", None)
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None:
        raise UnsupportedModelError("rope_scaling 'longrope' needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    for name in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(name), list):
            raise UnsupportedModelError(f"rope_scaling 'longrope' needs {name} as a list of numbers")
    if scaling.get("attention_factor") is None:
        factor = scaling.get("factor") or raw.get("max_position_embeddings", 2048) / int(original)
        factor = float(factor)
        scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return scaling


class Phi3Attention(Attention):
    """Llama's attention, rotating only the first rotary_dim dims of each head when the rotary is partial."""

    def __init__(self, cfg: Phi3ArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.rotary_dim = cfg.rotary_dim

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super().rotate_and_cache(positions, q, k, v, kv_cache, cos_sin_cache, meta)
        r = self.rotary_dim
        q_rot, k_rot = kernels.rotary_embedding(positions, q[..., :r], k[..., :r], cos_sin_cache)
        q = torch.cat((q_rot, q[..., r:]), dim=-1)
        k = torch.cat((k_rot, k[..., r:]), dim=-1)
        key_cache, value_cache = kv_cache
        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale=self.k_scale,
                                  v_scale=self.v_scale)
        return q


class Phi3DecoderLayer(DecoderLayer):
    """Llama's layer with Phi-3's attention."""

    attention_cls = Phi3Attention


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's model with Phi-3's layers; its cos/sin table spans the rotary dimension only."""

    layer_cls = Phi3DecoderLayer

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        cfg = self.config
        self.cos_sin_cache = kernels.compute_cos_sin_cache(
            cfg.rotary_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling, dtype
        ).to(device)


# The checkpoint's qkv_proj and gate_up_proj are ours as they are: nothing is fused at load.
FAMILIES = {"Phi3ForCausalLM": ModelFamily(Phi3ArchConfig, Phi3ForCausalLM, fused={})}
