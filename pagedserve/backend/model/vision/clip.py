"""CLIP's vision tower: a class token before the patches, learned positions, a LayerNorm before the encoder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.vision.encoder import VisionTower


class CLIPVisionEmbeddings(nn.Module):
    """Conv patches (no bias) after a class embedding, plus a learned position per token."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, patch = int(cfg["hidden_size"]), int(cfg["patch_size"])
        num_patches = (int(cfg["image_size"]) // patch) ** 2
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(int(cfg.get("num_channels", 3)), hidden, patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding(num_patches + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, 1 + P, H]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(VisionTower):
    """CLIPVisionModel's embeddings, pre_layrnorm (its spelling) and encoder; the post-norm is not used by the
    features a VLM reads."""

    DEFAULT_ACT = "quick_gelu"
    DEFAULT_EPS = 1e-5

    def __init__(self, cfg: dict[str, Any], num_layers: int):
        super().__init__(cfg, num_layers)
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(int(cfg["hidden_size"]), eps=float(cfg.get("layer_norm_eps", 1e-5)))

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pre_layrnorm(self.embeddings(pixel_values))
