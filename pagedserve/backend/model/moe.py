"""The mixture-of-experts pieces the MoE families share: the config fields, the sparse block (router, stacked
experts through kernels.fused_moe or each expert's quantized projections, an optional gated shared expert), the
layer that places it, and where each checkpoint expert tensor goes in the stacked parameters."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement
from pagedserve.backend.model.llama import MLP, DecoderLayer
from pagedserve.backend.model.quantized import QuantizedLinear


@dataclass
class MoEArchConfig(ModelArchConfig):
    """The expert fields, named as Qwen-MoE's config.json names them; a family's `_fields` fills them."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # rescale the top-k weights to sum to one
    round_routing_weights: bool = False  # the weights cast to the model's dtype before use (Qwen-MoE)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1.."
                                        f"{self.num_experts} (the number of experts)")
        if self.decoder_sparse_step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` runs the experts (else a dense MLP), as transformers decides it."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @staticmethod
    def moe_fields(raw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
        """The Qwen-MoE-named expert keys of `raw`, `defaults` (transformers' for the family) where one is absent."""
        def read(key: str) -> Any:
            value = raw.get(key)
            return defaults.get(key) if value is None else value

        return dict(
            # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map).
            num_experts=int(raw.get("num_local_experts") or read("num_experts")),
            num_experts_per_tok=int(read("num_experts_per_tok")),
            moe_intermediate_size=int(read("moe_intermediate_size")),
            norm_topk_prob=bool(read("norm_topk_prob")),
            shared_expert_intermediate_size=int(read("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(read("decoder_sparse_step")),
            mlp_only_layers=tuple(int(i) for i in read("mlp_only_layers") or ()),
        )


class StackedExperts(nn.Module):
    """Every expert's projections in two stacked parameters, the layout kernels.fused_moe reads."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # [gate | up] rows
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [T, H]
        """Each token's top-k experts (ids [T, k]) weighted and summed."""
        return kernels.fused_moe(x, self.w13, self.w2, weights, ids)


class QuantizedExperts(nn.Module):
    """Every expert's [gate | up] and down projections as QuantizedLinear layers (a GGUF file's experts as stored):
    the (token, expert) pairs sorted by expert, then one quantized GEMM pair per expert that has tokens."""

    def __init__(self, w13: list[QuantizedLinear], w2: list[QuantizedLinear]):
        super().__init__()
        self.w13, self.w2 = nn.ModuleList(w13), nn.ModuleList(w2)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [T, H]
        """As StackedExperts.forward."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // ids.shape[1]
        rows = x[token]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=len(self.w13)).tolist()):
            if count:
                part = slice(start, start + count)
                out[part] = self.w2[expert](kernels.silu_and_mul(self.w13[expert](rows[part])))
                start += count
        weighted = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, weighted)


class SparseMoeBlock(nn.Module):
    """Router, top-k experts and, when the family has one, a shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: MoEArchConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.round_weights = cfg.round_routing_weights
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size))
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Route each token to its top-k experts, weight and sum their outputs, add the gated shared expert."""
        weights, ids = kernels.topk_routing(self.gate(x), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """Llama's layer whose MLP is the sparse block in the layers the config makes sparse."""

    def __init__(self, cfg: MoEArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        if cfg.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(cfg)


# layers.N.<block>.experts.E.<projection>.weight, Mixtral's and Qwen-MoE's projection names both.
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_SHARED = re.compile(r"^(layers\.\d+)\.mlp\.shared_expert\.(gate_proj|up_proj)\.weight$")
_GATE_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
_DOWN = ("w2", "down_proj")


@dataclass(frozen=True)
class MoEFamily(ModelFamily):
    """Per-expert checkpoint tensors into their slots of the stacked w13 / w2 (or the stacked form as it is),
    Mixtral's block_sparse_moe read as our mlp, the shared expert's gate/up fused at its own size."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        """Where the checkpoint tensor `name` goes; names that are not the experts' fall back to the base."""
        short = name.removeprefix("model.")
        if (match := _EXPERT.match(short)) is not None:
            return _expert_placement(name, match, cfg)
        if (match := _STACKED.match(short)) is not None:
            return Placement(f"{match[1]}.mlp.experts.{'w13' if match[2] == 'gate_up_proj' else 'w2'}")
        if (match := _SHARED.match(short)) is not None:
            size = cfg.shared_expert_intermediate_size
            start = size * (match[2] == "up_proj")
            return Placement(f"{match[1]}.mlp.shared_expert.gate_up_proj.weight", (slice(start, start + size),))
        return super().placement(name.replace(".block_sparse_moe.", ".mlp."), cfg)


def _expert_placement(name: str, match: re.Match, cfg: MoEArchConfig) -> Placement:
    """The slot of one expert's gate, up or down projection."""
    layer, expert, projection = match[1], int(match[2]), match[3]
    if expert >= cfg.num_experts:
        raise ValueError(f"checkpoint tensor {name!r} is expert {expert} but the config has {cfg.num_experts}")
    if projection in _DOWN:
        return Placement(f"{layer}.mlp.experts.w2", (expert,))
    if projection not in _GATE_PART:
        raise ValueError(f"checkpoint tensor {name!r} is no expert projection pagedserve knows")
    size = cfg.moe_intermediate_size
    start = size * _GATE_PART[projection]
    return Placement(f"{layer}.mlp.experts.w13", (expert, slice(start, start + size)))
