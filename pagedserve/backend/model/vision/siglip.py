"""SigLIP's vision tower: biased conv patches plus learned positions, no class token, no pre-norm."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.vision.encoder import VisionTower


class SiglipVisionEmbeddings(nn.Module):
    """Conv patches (with bias) plus a learned position per patch."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, patch = int(cfg["hidden_size"]), int(cfg["patch_size"])
        self.patch_embedding = nn.Conv2d(int(cfg.get("num_channels", 3)), hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding((int(cfg["image_size"]) // patch) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, H]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(VisionTower):
    """SiglipVisionModel's embeddings and encoder; its post-norm and pooling head are not used by the features a
    VLM reads."""

    DEFAULT_ACT = "gelu_pytorch_tanh"

    def __init__(self, cfg: dict[str, Any], num_layers: int):
        super().__init__(cfg, num_layers)
        self.embeddings = SiglipVisionEmbeddings(cfg)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.embeddings(pixel_values)
