"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache; every kernel goes through `pagedserve.kernels`."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve import kernels
from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.family import ModelFamily


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise x (after adding residual, when given)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Self-attention with fused QKV projection, rotary embedding and paged K/V."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.window_of(layer_idx)
        self.logits_soft_cap: float | None = None  # Gemma 2 caps its scores
        # An fp8 KV cache holds K / k_scale and V / v_scale (kernels.kv8); the checkpoint's, set once at load.
        self.k_scale, self.v_scale = 1.0, 1.0
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Project to Q/K/V, rotate, write K/V into the paged cache, attend, project out."""
        num_tokens = hidden.shape[0]
        q, k, v = self.project_qkv(hidden)
        q = self.rotate_and_cache(positions, q, k, v, kv_cache, cos_sin_cache, meta)
        out = self.attend(q, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [T, Hq, D], K and V [T, Hkv, D] (views into the fused projection's output)."""
        num_tokens = hidden.shape[0]
        # split_with_sizes: Tensor.split's Python wrapper costs more than the views, once a layer every step.
        q, k, v = self.qkv_proj(hidden).split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """Rotate Q and K, write the rotated K and V into their slots; returns the rotated Q."""
        key_cache, value_cache = kv_cache
        return kernels.rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, key_cache, value_cache,
                                                  meta.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:  # -> [T, Hq, D]
        """Causal attention of Q over each sequence's cached K/V (the keys of its window, for a sliding layer)."""
        key_cache, value_cache = kv_cache
        # Gemma 3's image runs see each other both ways; the keyword only when a step has one.
        extra = {} if meta.bidirectional_ranges is None else {"bidirectional_ranges": meta.bidirectional_ranges}
        return kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            self.scale,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            **extra,
        )


class HeadNormedAttention:
    """Mixin before an Attention class: each Q and K head normalised over its head_dim values (`qk_norm_cls`)
    before the rotary embedding, as Qwen3 and Gemma 3 do."""

    qk_norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = self.qk_norm_cls(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = self.qk_norm_cls(cfg.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(hidden)
        return _per_head(self.q_norm, q), _per_head(self.k_norm, k), v


def _per_head(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, H, D]
    """`norm` over each head's D values."""
    num_tokens, heads, head_dim = x.shape
    return norm(x.reshape(num_tokens * heads, head_dim)).view(num_tokens, heads, head_dim)


class MLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused."""

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, the residual carried through fused add-norms. A family swaps a part
    by setting attention_cls, mlp_cls or norm_cls on a subclass."""

    attention_cls: type[Attention] = Attention
    mlp_cls: type[nn.Module] = MLP
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelArchConfig, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx)
        self.mlp = self.mlp_cls(cfg)
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer; returns (hidden, residual) with the residual add deferred to the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.after_attention(self.self_attn(positions, hidden, kv_cache, cos_sin_cache, meta), residual)

    def after_attention(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention's output to the layer's (hidden, residual): add-norm, then the MLP."""
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus lm_head; Mistral and Qwen2 differ only in config (biases, window). A family sets
    layer_cls / norm_cls on a subclass, or overrides embed / init_rope."""

    layer_cls: type[DecoderLayer] = DecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelArchConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_position = max_position
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        """Build the cos/sin table (after the weights are on their device)."""
        cfg = self.config
        self.cos_sin_cache = kernels.compute_cos_sin_cache(
            cfg.head_dim, self.max_position, cfg.rope_theta, cfg.rope_scaling, dtype
        ).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]: given by a VLM's runner, image rows in place
    ) -> torch.Tensor:  # -> final hidden states [T, H]
        """Run every layer over the step's flat tokens, writing their K/V into the cache."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        positions, cos_sin_cache = self.rope_inputs(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, cos_sin_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def rope_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the positions the layers index the rotary table at, the table); M-RoPE's family mixes a table a step."""
        return positions, self.cos_sin_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """The input embeddings of the step's tokens."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] fp32
        """Project selected hidden rows onto the vocabulary, in fp32."""
        return kernels.to_float32(self.lm_head(hidden))


FAMILIES = {arch: ModelFamily(ModelArchConfig, LlamaForCausalLM)
            for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")}
