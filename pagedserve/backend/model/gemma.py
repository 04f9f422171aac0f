"""Gemma 2 and Gemma 3 (text): Llama's decoder with GeGLU (gelu-tanh), (1 + weight) RMSNorms, a norm after the
attention and around the feed-forward, embeddings scaled by sqrt(hidden), the attention scale from
query_pre_attn_scalar and interleaved sliding-window / global layers. Gemma 2 soft-caps the attention scores and
the final logits; Gemma 3 normalises Q and K per head and rotates its sliding layers with a local rope base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedserve import kernels
from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily
from pagedserve.backend.model.llama import (
    MLP,
    Attention,
    DecoderLayer,
    HeadNormedAttention,
    LlamaForCausalLM,
    RMSNorm,
)


@dataclass
class Gemma2ArchConfig(ModelArchConfig):
    """Gemma 2's config.json, with transformers' defaults for the keys a config may leave out."""

    HIDDEN_ACTS = ("gelu_pytorch_tanh",)
    SLIDING_PATTERN: ClassVar[int] = 2  # without layer_types: every SLIDING_PATTERN-th layer is global
    DEFAULTS: ClassVar[dict[str, Any]] = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None  # Gemma 3's base for the sliding layers; None: one table for all

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        raw = cls._normalised(raw)
        fields = super()._fields(arch, raw)
        fields["query_pre_attn_scalar"] = float(raw.get("query_pre_attn_scalar", 256))
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = raw.get(name, cls.DEFAULTS.get(name))
            fields[name] = float(value) if value else None
        return fields

    @classmethod
    def _normalised(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """config.json with the base class's keys filled as transformers' Gemma configs default them."""
        if raw.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention is not supported (pagedserve attends causally)")
        raw = dict(raw)
        raw["hidden_act"] = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        raw.setdefault("head_dim", 256)
        raw.setdefault("tie_word_embeddings", True)
        raw.setdefault("sliding_window", 4096)
        if raw.get("layer_types") is None:
            pattern = int(raw.get("sliding_window_pattern", cls.SLIDING_PATTERN))
            raw["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(int(raw["num_hidden_layers"]))]
        return raw


@dataclass
class Gemma3ArchConfig(Gemma2ArchConfig):
    """Gemma 3's text config.json: rope per layer type (rope_parameters' full_attention / sliding_attention, or
    rope_theta, rope_scaling and rope_local_base_freq), five sliding layers to a global one, no attention cap."""

    SLIDING_PATTERN = 6
    DEFAULTS = {}

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            local = params.get("sliding_attention") or {}
            raw = {**raw, "rope_parameters": params["full_attention"]}
        else:
            local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
            raw = {"rope_theta": 1_000_000.0, **raw}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope type {local['rope_type']!r} for the sliding layers is not supported; "
                                        "supported: default")
        fields = super()._fields(arch, raw)
        fields["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
        fields["attn_logit_softcapping"] = None  # transformers' Gemma 3 attention does not read it
        return fields


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight): Gemma checkpoints store the offset from one."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernels.rms_norm(x, 1.0 + self.weight, self.eps, residual)


class GemmaMLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma2Attention(Attention):
    """Attention scaled by query_pre_attn_scalar ** -0.5, its scores soft-capped where the config says so."""

    def __init__(self, cfg: Gemma2ArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.logits_soft_cap = cfg.attn_logit_softcapping


class Gemma3Attention(HeadNormedAttention, Gemma2Attention):
    """Gemma 2's attention with each Q and K head (1 + weight) RMS-normalised before the rotary embedding."""

    qk_norm_cls = GemmaRMSNorm


class Gemma2DecoderLayer(DecoderLayer):
    """Norm, attention, norm, residual add; norm, GeGLU, norm, residual add (adds deferred to the next norm)."""

    attention_cls = Gemma2Attention
    mlp_cls = GemmaMLP
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def after_attention(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output normed before the residual add; the MLP's normed on both sides."""
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer with Gemma 3's attention."""

    attention_cls = Gemma3Attention


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma's decoder: scaled embeddings, a local rope table for the sliding layers where the config has one,
    final logits soft-capped where the config says so."""

    layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: Gemma2ArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.register_buffer("local_cos_sin_cache", torch.empty(0), persistent=False)

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        super().init_rope(dtype, device)
        cfg = self.config
        if cfg.local_rope_theta is not None:
            self.local_cos_sin_cache = kernels.compute_cos_sin_cache(
                cfg.head_dim, self.max_position, cfg.local_rope_theta, None, dtype
            ).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]: given by a VLM's runner, image rows in place
    ) -> torch.Tensor:  # -> final hidden states [T, H]
        """Every layer over the step's tokens, each sliding layer rotating with the local table when there is one."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        local = self.local_cos_sin_cache if self.config.local_rope_theta is not None else self.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            table = local if layer.self_attn.sliding_window is not None else self.cos_sin_cache
            hidden, residual = layer(positions, hidden, residual, kv_cache, table, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Embeddings times sqrt(hidden_size), the factor rounded to the model dtype as transformers rounds it."""
        hidden = self.embed_tokens(input_ids)  # in the model's dtype, from a float or a quantized table
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] fp32
        """lm_head's logits, soft-capped (cap * tanh(logit / cap)) in the model dtype, as fp32."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return kernels.to_float32(logits)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma's decoder with Gemma 3's layers."""

    layer_cls = Gemma3DecoderLayer


FAMILIES = {
    "Gemma2ForCausalLM": ModelFamily(Gemma2ArchConfig, Gemma2ForCausalLM),
    "Gemma3ForCausalLM": ModelFamily(Gemma3ArchConfig, Gemma3ForCausalLM),
}
