"""ModernBERT (gte-modernbert, modernbert-embed, ModernBERT rerankers): an encoder with pre-norm blocks (LayerNorms
without bias), rotary positions whose base differs between global and local layers, global attention every
n-th layer and a bidirectional window of +-local_attention/2 tokens in the others, a GeGLU MLP, and a final norm.
`ModernBertForSequenceClassification` pools CLS or mean rows through dense + activation + norm, then a classifier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.bert import EncoderArchConfig, bidirectional_attention
from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement

# transformers' ACT2FN names -> torch's gelu approximation.
_GELU = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def _layer_thetas(raw: dict[str, Any], num_layers: int) -> tuple[tuple[bool, ...], float, float]:
    """(per layer: attends locally, the global rope base, the local one) from layer_types / rope_parameters (new
    configs) or global_attn_every_n_layers / global_rope_theta / local_rope_theta (the hub's)."""
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("global_attn_every_n_layers", 3))
        types = ["sliding_attention" if i % every else "full_attention" for i in range(num_layers)]
    params = raw.get("rope_parameters") or {}
    for kind in ("full_attention", "sliding_attention"):
        rope_type = (params.get(kind) or {}).get("rope_type", "default")
        if rope_type != "default":
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported for ModernBERT; supported: default")
    global_theta = (params.get("full_attention") or {}).get("rope_theta", raw.get("global_rope_theta", 160000.0))
    local_theta = (params.get("sliding_attention") or {}).get("rope_theta", raw.get("local_rope_theta", 10000.0))
    return tuple(t == "sliding_attention" for t in types), float(global_theta), float(local_theta)


@dataclass
class ModernBertArchConfig(EncoderArchConfig):
    """ModernBERT's config.json: the local layers and their window, the two rotary bases, the norms' bias, and a
    classifier's pooling, bias and activation."""

    local_layers: tuple[bool, ...] = ()
    local_half_window: int = 64
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    norm_bias: bool = False
    classifier_pooling: str = "cls"
    classifier_bias: bool = False
    classifier_activation: str = "gelu"

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        acts = (raw.get("hidden_activation", "gelu"), raw.get("classifier_activation", "gelu"))
        for key, act in zip(("hidden_activation", "classifier_activation"), acts, strict=True):
            if act not in _GELU:
                raise UnsupportedModelError(f"{key} {act!r} is not supported; supported: {', '.join(_GELU)}")
        pooling = raw.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise UnsupportedModelError(f"classifier_pooling {pooling!r} is not supported; supported: cls, mean")
        heads, hidden, layers = int(raw["num_attention_heads"]), int(raw["hidden_size"]), int(raw["num_hidden_layers"])
        local_layers, global_theta, local_theta = _layer_thetas(raw, layers)
        labels = raw.get("id2label") or {}
        bias = bool(raw.get("attention_bias", False))
        return dict(
            architecture=arch, hidden_act=acts[0], vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]), num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=hidden // heads, rms_norm_eps=0.0, max_position_embeddings=int(raw.get("max_position_embeddings",
            8192)), rope_theta=global_theta, rope_scaling=None, tie_word_embeddings=False, qkv_bias=bias, o_bias=bias,
            mlp_bias=bool(raw.get("mlp_bias", False)), sliding_window=None,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"), eos_token_ids=(), bos_token_id=None,
            type_vocab_size=0, layer_norm_eps=float(raw.get("norm_eps", 1e-5)),
            id2label=tuple(str(labels[k]) for k in sorted(labels, key=int)) if arch.endswith("Classification") else (),
            local_layers=local_layers, local_half_window=int(raw.get("local_attention", 128)) // 2,
            global_rope_theta=global_theta, local_rope_theta=local_theta, norm_bias=bool(raw.get("norm_bias", False)),
            classifier_pooling=pooling, classifier_bias=bool(raw.get("classifier_bias", False)),
            classifier_activation=acts[1],
        )


def _norm(cfg: ModernBertArchConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on [T, heads, D] in fp32 (cos, sin: [T, 1, D]), back in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Embeddings(nn.Module):
    """Token embeddings then LayerNorm (no positions: they are rotary)."""

    def __init__(self, cfg: ModernBertArchConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)


class Attention(nn.Module):
    """Fused Wqkv, rotary at this layer's base, bidirectional attention (over a window on a local layer), Wo."""

    def __init__(self, cfg: ModernBertArchConfig, local: bool):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.window = cfg.local_half_window if local else None
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.qkv_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens = hidden.shape[0]
        q, k, v = self.Wqkv(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = bidirectional_attention(q, k, v, meta, self.head_dim**-0.5, self.window)
        return self.Wo(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """GeGLU: Wi gives the input and the gate; act(input) * gate through Wo."""

    def __init__(self, cfg: ModernBertArchConfig):
        super().__init__()
        self.approximate = _GELU[cfg.hidden_act]
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(F.gelu(up, approximate=self.approximate) * gate)


class EncoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual; the first layer's attention input is not normed
    (its embeddings just were)."""

    def __init__(self, cfg: ModernBertArchConfig, index: int):
        super().__init__()
        self.local = bool(cfg.local_layers[index])
        self.attn_norm = nn.Identity() if index == 0 else _norm(cfg)
        self.attn = Attention(cfg, self.local)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), rope, meta)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertModel(nn.Module):
    """The encoder over a step's flat tokens; `forward` has the decoders' signature (the KV caches unused)."""

    uses_kv_cache = False

    def __init__(self, cfg: ModernBertArchConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.default_pooling = cfg.classifier_pooling
        self.pooling_head: nn.Module | None = None
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg)
        self.inv_freq: dict[bool, torch.Tensor] = {}

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        """The inverse frequencies of the global (False) and local (True) layers' bases."""
        exponents = torch.arange(0, self.config.head_dim, 2, dtype=torch.float32, device=device) / self.config.head_dim
        self.inv_freq = {local: 1.0 / (theta**exponents) for local, theta in
                         ((False, self.config.global_rope_theta), (True, self.config.local_rope_theta))}

    def _rope(self, positions: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[local]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [T, 1, D]
        return angles.cos(), angles.sin()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:  # -> [T, H]
        """Every layer over the step's sequences, each whole and attending both ways (token types unused)."""
        hidden = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        ropes = {local: self._rope(positions, local) for local in (False, True)}
        for layer in self.layers:
            hidden = layer(hidden, ropes[layer.local], meta)
        return self.final_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, 0]
        """An encoder samples nothing."""
        return hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)


class PredictionHead(nn.Module):
    """ModernBERT's head: dense, activation, norm."""

    def __init__(self, cfg: ModernBertArchConfig):
        super().__init__()
        self.approximate = _GELU[cfg.classifier_activation]
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.norm = _norm(cfg)


class ClassifierHead(nn.Module):
    """[N, H] pooled rows -> head -> classifier -> [N, labels]."""

    def __init__(self, cfg: ModernBertArchConfig):
        super().__init__()
        self.head = PredictionHead(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, len(cfg.id2label))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        head = self.head
        return self.classifier(head.norm(F.gelu(head.dense(pooled), approximate=head.approximate)))


class ModernBertForSequenceClassification(ModernBertModel):
    """The encoder whose CLS or mean row goes through the head and the classifier."""

    def __init__(self, cfg: ModernBertArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.pooling_head = ClassifierHead(cfg)


class ModernBertFamily(ModelFamily):
    """Checkpoint names are ours after `model.`; a classifier's `head.` and `classifier.` go into its head, a
    masked-LM head is dropped."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        name = name.removeprefix("model.")
        if name.startswith(("head.", "classifier.")):
            return Placement(f"pooling_head.{name}") if cfg.architecture.endswith("Classification") else None
        if name.startswith("decoder."):
            return None
        return super().placement(name, cfg)


FAMILIES = {
    "ModernBertModel": ModernBertFamily(ModernBertArchConfig, ModernBertModel, {}),
    "ModernBertForSequenceClassification": ModernBertFamily(ModernBertArchConfig, ModernBertForSequenceClassification,
                                                            {}),
}
