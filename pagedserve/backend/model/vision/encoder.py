"""The pre-norm ViT encoder CLIP and SigLIP share: LayerNorm, bidirectional multi-head attention over an image's
patches, LayerNorm, a two-layer MLP; a tower subclass states its embedding and activation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.backend.model.config import UnsupportedModelError


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function config.json names; UnsupportedModelError for another."""
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {name!r} is not supported in a vision tower; supported: "
                                    f"{', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased q/k/v/out projections (checkpoint names kept)."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, H] -> [N, P, H]
        """Every patch attends to every patch of its image."""
        n, p, _ = x.shape
        q, k, v = (proj(x).view(n, p, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(self.head_dim))
        return self.out_proj(out.transpose(1, 2).reshape(n, p, -1))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x)))."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.act = activation(act)
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: dict[str, Any], default_act: str):
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("layer_norm_eps", 1e-6))
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, int(cfg["num_attention_heads"]))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(hidden, int(cfg["intermediate_size"]), cfg.get("hidden_act", default_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The stack of encoder layers (only as many as the features read)."""

    def __init__(self, cfg: dict[str, Any], num_layers: int, default_act: str):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, default_act) for _ in range(num_layers))


class VisionTower(nn.Module):
    """A ViT over whole images. `hidden_states(pixels)` is transformers' `hidden_states` tuple cut at the
    layers built: entry 0 the embedded patches, entry i the output of layer i."""

    DEFAULT_ACT = "gelu"
    DEFAULT_EPS = 1e-6

    def __init__(self, cfg: dict[str, Any], num_layers: int):
        super().__init__()
        self.image_size, self.patch_size = int(cfg["image_size"]), int(cfg["patch_size"])
        self.encoder = VisionEncoder({"layer_norm_eps": self.DEFAULT_EPS, **cfg}, num_layers, self.DEFAULT_ACT)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, H]
        """The embedded patches the encoder starts from."""
        raise NotImplementedError

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[embedded patches, after layer 1, ..., after the last layer built], each [N, P, H]."""
        size = pixel_values.shape[-2:]
        if tuple(size) != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values are {tuple(size)}, the vision tower takes {self.image_size} square")
        states = [self.embed(pixel_values)]
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        return states
