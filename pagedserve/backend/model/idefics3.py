"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration): a SigLIP vision transformer over fixed-size tiles
(its positions read Idefics3's way, its post-norm applied), a connector that pixel-shuffles each tile's patches
(scale_factor**2 neighbours into one token) and projects them without bias, and a Llama decoder. The processor
cuts an image into tiles plus a global view, each tile a run of image tokens with text between (row/column tags):
the engine takes every tile as an image of its own (one placeholder span each)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement, renamed
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.vision.siglip import SiglipVisionTower


@dataclass
class Idefics3ArchConfig(ModelArchConfig):
    """The Llama decoder's fields from text_config, the vision config, the image token and the pixel shuffle's
    scale factor."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    image_token_id: int = -1
    scale_factor: int = 2

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        text = dict(raw.get("text_config") or {})
        if text.get("model_type", "llama") != "llama":
            raise UnsupportedModelError(f"text_config model_type {text.get('model_type')!r} is not supported in "
                                        f"{arch}; supported: llama")
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        fields = super()._fields("LlamaForCausalLM", text)
        fields.update(architecture=arch, vision_config=dict(raw["vision_config"]),
                      image_token_id=int(raw.get("image_token_id", 128257)),
                      scale_factor=int(raw.get("scale_factor", 2)))
        return fields


class Idefics3VisionTower(SiglipVisionTower):
    """SigLIP's tower with Idefics3's position ids (a full tile's patches bucketed onto the position grid, as
    transformers computes them) and the post-norm after the last layer."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg, int(cfg["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(int(cfg["hidden_size"]), eps=float(cfg.get("layer_norm_eps", 1e-6)))

    def position_ids(self) -> torch.Tensor:
        """[P] position of each patch of a tile every patch of which is image."""
        side = self.image_size // self.patch_size
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        coords = torch.clamp(torch.arange(side, dtype=torch.float32) * (1.0 / torch.tensor(float(side))),
                             max=1.0 - 1e-6)
        buckets = torch.bucketize(coords, boundaries, right=True)
        return (buckets[:, None] * side + buckets[None, :]).reshape(-1)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, H]
        emb = self.embeddings
        patches = emb.patch_embedding(pixel_values.to(emb.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + emb.position_embedding(self.position_ids().to(patches.device))

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The post-normed last hidden states [N, P, H]."""
        return self.post_layernorm(self.hidden_states(pixel_values)[-1])


class Idefics3Connector(nn.Module):
    """Pixel shuffle (each scale x scale block of patches into one token's features), then a bias-free linear."""

    def __init__(self, cfg: Idefics3ArchConfig):
        super().__init__()
        self.scale = cfg.scale_factor
        self.modality_projection = nn.Module()
        width = int(cfg.vision_config["hidden_size"]) * self.scale**2
        self.modality_projection.proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, H] -> [N, P / scale**2, text hidden]
        n, patches, hidden = x.shape
        side, s = int(patches**0.5), self.scale
        x = x.view(n, side, side // s, hidden * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, hidden * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, patches // s**2, hidden * s * s))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Llama's decoder with the tile encoder beside it; an image handed to `encode_images` is one tile."""

    def __init__(self, cfg: Idefics3ArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.vision_model = Idefics3VisionTower(cfg.vision_config)
        self.connector = Idefics3Connector(cfg)

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each tile's tokens [P / scale**2, hidden], the tiles in one batch (pixel_values [1, C, S, S] each)."""
        table = self.embed_tokens.weight  # (linears may be prepacked: the embedding table names device and dtype)
        pixels = torch.cat([image["pixel_values"] for image in images]).to(table.device)
        return list(self.connector(self.vision_model.features(pixels)).to(table.dtype))


_RENAMES = (("model.text_model.", ""), ("text_model.", ""), ("model.vision_model.", "vision_model."),
            ("model.connector.", "connector."))
_VISION = re.compile(r"^(vision_model|connector)\.")


class Idefics3Family(ModelFamily):
    """Decoder tensors go where Llama's do (q/k/v and gate/up fused); the tower's and connector's keep their
    names."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        name = renamed(name, _RENAMES)
        if _VISION.match(name):
            return Placement(name)
        return super().placement(name, cfg)


FAMILIES = {"Idefics3ForConditionalGeneration": Idefics3Family(Idefics3ArchConfig, Idefics3ForConditionalGeneration)}
