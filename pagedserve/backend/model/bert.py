"""BERT: an encoder. Bidirectional attention over each whole sequence (no paged KV: a request runs in one step),
learned absolute positions, token type embeddings, post-layer-norm blocks with a GELU MLP. `BertModel` pools
for embeddings; `BertForSequenceClassification` adds the pooler (dense + tanh on [CLS]) and a classifier."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import Fused, ModelFamily, Placement


@dataclass
class EncoderArchConfig(ModelArchConfig):
    """An encoder's config.json: LayerNorm eps, token types, the position offset (XLM-R counts positions from
    padding_idx + 1), and a classifier's labels."""

    HIDDEN_ACTS = ("gelu",)

    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-12
    position_offset: int = 0
    id2label: tuple[str, ...] = ()

    @property
    def is_encoder(self) -> bool:
        """Encoders attend both ways over a whole sequence and keep no KV cache."""
        return True

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        act = raw.get("hidden_act", "gelu")
        if act not in cls.HIDDEN_ACTS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {', '.join(cls.HIDDEN_ACTS)}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"position_embedding_type {raw['position_embedding_type']!r} is not "
                                        "supported; supported: absolute")
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        offset = int(raw.get("pad_token_id") or 0) + 1 if cls.counts_positions_after_padding else 0
        labels = raw.get("id2label") or {}
        return dict(
            architecture=arch, hidden_act=act, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, rms_norm_eps=0.0,
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)) - offset, rope_theta=0.0,
            rope_scaling=None, tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True,
            sliding_window=None, torch_dtype=raw.get("dtype") or raw.get("torch_dtype"), eos_token_ids=(),
            bos_token_id=None, type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), position_offset=offset,
            id2label=tuple(str(labels[k]) for k in sorted(labels, key=int)) if arch.endswith("Classification") else (),
        )

    counts_positions_after_padding = False


class Embeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, cfg: EncoderArchConfig, max_position: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.position_offset = cfg.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:  # [T] -> [T, H]
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                            scale: float, window: int | None = None) -> torch.Tensor:  # [T, H, D] each -> [T, H, D]
    """Each sequence's queries over all its own keys (`window`: those at most that many tokens away): one SDPA
    call a sequence with 4-D inputs [1, H, L, D] (SDPA's fused CPU kernel; one padded, masked call over all the
    step's sequences took its slow path and attended to the padding)."""
    bounds = meta.cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        mask = None
        if window is not None and end - start > window + 1:
            index = torch.arange(end - start, device=q.device)
            mask = (index[:, None] - index[None, :]).abs() <= window
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    return out


class SelfAttention(nn.Module):
    """Fused Q/K/V projection and bidirectional attention (BERT's attention.self)."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = bidirectional_attention(q, k, v, meta, self.head_dim**-0.5)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


class DenseNorm(nn.Module):
    """A projection added to the residual, then LayerNorm (BERT's attention.output and output)."""

    def __init__(self, cfg: EncoderArchConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class AttentionBlock(nn.Module):
    """BERT's `attention`: self-attention then its output add-norm."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden, meta), hidden)


class Intermediate(nn.Module):
    """The MLP's up projection and GELU."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class EncoderLayer(nn.Module):
    """Attention add-norm, then the GELU MLP add-norm (post-norm)."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.attention = AttentionBlock(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg, cfg.intermediate_size)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class Encoder(nn.Module):
    """The stack of layers (BERT's `encoder`)."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class BertModel(nn.Module):
    """The encoder over a step's flat tokens; `forward` has the decoders' signature (the KV caches unused)."""

    uses_kv_cache = False  # the runner keeps its blocks as bookkeeping only
    default_pooling = "cls"

    def __init__(self, cfg: EncoderArchConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.pooling_head: nn.Module | None = None  # a classifier's, onto its labels
        self.embeddings = Embeddings(cfg, max_position)
        self.encoder = Encoder(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:  # -> [T, H]
        """Every layer over the step's sequences, each whole and attending both ways."""
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, 0]
        """An encoder samples nothing: no row ever has logits."""
        return hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        """Positions are learned embeddings: nothing to build."""


class Pooler(nn.Module):
    """BERT's pooler: dense + tanh over the [CLS] row."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class BertClassifierHead(nn.Module):
    """The pooler, then the classifier onto the labels: [N, H] pooled [CLS] rows -> [N, labels]."""

    def __init__(self, cfg: EncoderArchConfig):
        super().__init__()
        self.pooler = Pooler(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, len(cfg.id2label))

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(cls_rows)))


class BertForSequenceClassification(BertModel):
    """BertModel whose [CLS] row goes through the pooler and the classifier."""

    def __init__(self, cfg: EncoderArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.pooling_head = BertClassifierHead(cfg)


class EncoderFamily(ModelFamily):
    """An encoder's checkpoint names: its prefix (`bert.`, `roberta.`) dropped, the pooler kept only where a
    head uses it, Q/K/V fused."""

    prefixes = ("bert.", "roberta.")
    head_names: dict[str, str] = {}  # checkpoint name prefix -> ours, for a classifier's head

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        for prefix in self.prefixes:
            name = name.removeprefix(prefix)
        for theirs, ours in self.head_names.items():
            if name.startswith(theirs):
                return Placement(ours + name[len(theirs):])
        if name.startswith(("pooler.", "lm_head.", "cls.")):
            return None  # the masked-LM head, or a pooler no head uses
        return super().placement(name, cfg)


_ENCODER_FUSED = {"qkv": Fused(("query", "key", "value"), lambda cfg: [cfg.hidden_size] * 3)}
_IGNORED = re.compile(r"position_ids$")


class BertClassifierFamily(EncoderFamily):
    """BertForSequenceClassification: the pooler and classifier go into the head."""

    head_names = {"pooler.": "pooling_head.pooler.", "classifier.": "pooling_head.classifier."}


FAMILIES = {
    "BertModel": EncoderFamily(EncoderArchConfig, BertModel, _ENCODER_FUSED, _IGNORED),
    "BertForSequenceClassification": BertClassifierFamily(EncoderArchConfig, BertForSequenceClassification,
                                                          _ENCODER_FUSED, _IGNORED),
}
