"""Qwen2-MoE and Qwen3-MoE: Qwen2's (QKV bias) and Qwen3's (per-head q/k norms) decoders whose layers every
`decoder_sparse_step`, but for `mlp_only_layers`, are sparse blocks; the top-k weights renormalised only with
`norm_topk_prob` and cast to the model's dtype, as transformers does; Qwen2-MoE adds a shared expert scaled by
sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.moe import MoEArchConfig, MoEDecoderLayer, MoEFamily
from pagedserve.backend.model.qwen3 import Qwen3Attention

# transformers' config defaults, for a config.json that leaves a key out.
_QWEN2_MOE_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                       "norm_topk_prob": False, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1}
_QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                       "norm_topk_prob": False, "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1}


@dataclass
class QwenMoeArchConfig(MoEArchConfig):
    """Qwen2-MoE's / Qwen3-MoE's config.json: the expert keys, a window only with use_sliding_window, and
    Qwen2-MoE's qkv_bias (Qwen3-MoE's attention_bias covers q/k/v/o, as the base reads it)."""

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super()._fields(arch, raw)
        qwen2 = arch == "Qwen2MoeForCausalLM"
        fields.update(cls.moe_fields(raw, _QWEN2_MOE_DEFAULTS if qwen2 else _QWEN3_MOE_DEFAULTS),
                      round_routing_weights=True)
        if qwen2:
            fields.update(qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False)
        if not raw.get("use_sliding_window", False):
            fields["sliding_window"] = None
        return fields


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Llama's model with Qwen2-MoE's sparse layers."""

    layer_cls = MoEDecoderLayer


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    """The sparse layer with Qwen3's attention."""

    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Llama's model with Qwen3-MoE's layers."""

    layer_cls = Qwen3MoeDecoderLayer


FAMILIES = {
    "Qwen2MoeForCausalLM": MoEFamily(QwenMoeArchConfig, Qwen2MoeForCausalLM),
    "Qwen3MoeForCausalLM": MoEFamily(QwenMoeArchConfig, Qwen3MoeForCausalLM),
}
