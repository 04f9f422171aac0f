"""Mixtral: Mistral's decoder whose every MLP is a sparse block of `num_local_experts` experts, top-k weights
renormalised to sum to one (kept in fp32, as transformers keeps them); the checkpoint's
block_sparse_moe.experts.N.w1 / w3 / w2 are each expert's gate / up / down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.moe import MoEArchConfig, MoEDecoderLayer, MoEFamily


@dataclass
class MixtralArchConfig(MoEArchConfig):
    """Mixtral's config.json: num_local_experts experts of intermediate_size, always renormalised."""

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super()._fields(arch, raw)
        fields.update(num_experts=int(raw.get("num_local_experts", 8)),
                      num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                      moe_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)
        return fields


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's model with sparse layers."""

    layer_cls = MoEDecoderLayer


FAMILIES = {"MixtralForCausalLM": MoEFamily(MixtralArchConfig, MixtralForCausalLM)}
