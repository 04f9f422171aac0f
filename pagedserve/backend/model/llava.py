"""LLaVA (LlavaForConditionalGeneration): a CLIP or SigLIP vision tower, the hidden states of its feature layer(s)
(the class token dropped under the "default" select strategy), a two-layer MLP projector into the language
model's width, and a Llama / Mistral / Qwen2 decoder whose image placeholder tokens take those embeddings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement, renamed
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.vision import vision_tower_for
from pagedserve.backend.model.vision.encoder import activation

_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_SELECT_STRATEGIES = ("default", "full")


@dataclass
class LlavaArchConfig(ModelArchConfig):
    """The language model's fields read from text_config, plus the vision tower's config and how its features
    are read and projected."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    image_token_id: int = -1
    vision_feature_layers: tuple[int, ...] = (-2,)
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        text = dict(raw.get("text_config") or {})
        text_type = text.get("model_type", "llama")
        if text_type not in _TEXT_ARCHITECTURES:
            raise UnsupportedModelError(f"text_config model_type {text_type!r} is not supported in {arch}; "
                                        f"supported: {', '.join(sorted(_TEXT_ARCHITECTURES))}")
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        fields = super()._fields(_TEXT_ARCHITECTURES[text_type], text)
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in _SELECT_STRATEGIES:
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported; "
                                        f"supported: {', '.join(_SELECT_STRATEGIES)}")
        layers = raw.get("vision_feature_layer", -2)
        fields.update(
            architecture=arch,
            vision_config=dict(raw["vision_config"]),
            image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
            vision_feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
            vision_feature_select_strategy=strategy,
            projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        )
        return fields

    def feature_indices(self) -> list[int]:
        """The vision tower's hidden-state indices the features read (0: the embedded patches)."""
        depth = int(self.vision_config["num_hidden_layers"])
        return [layer if layer >= 0 else depth + 1 + layer for layer in self.vision_feature_layers]


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(features)))."""

    def __init__(self, cfg: LlavaArchConfig):
        super().__init__()
        width = int(cfg.vision_config["hidden_size"]) * len(cfg.vision_feature_layers)
        self.linear_1 = nn.Linear(width, cfg.hidden_size, bias=cfg.projector_bias)
        self.act = activation(cfg.projector_hidden_act)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The language model (Llama's decoder, unchanged) with the vision tower and projector beside it; the engine
    calls `encode_images` for a step's new images and hands the rows to `forward` as inputs_embeds."""

    def __init__(self, cfg: LlavaArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.feature_indices = cfg.feature_indices()
        self.vision_tower = vision_tower_for(cfg.vision_config, max(self.feature_indices))
        self.multi_modal_projector = LlavaProjector(cfg)
        self.drop_class_token = cfg.vision_feature_select_strategy == "default"

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's embeddings [its tokens, hidden], in one batch through the tower; an image is its
        processor's outputs (pixel_values [1, C, S, S])."""
        table = self.embed_tokens.weight  # (linears may be prepacked: the embedding table names device and dtype)
        pixels = torch.cat([image["pixel_values"] for image in images]).to(table.device)
        states = self.vision_tower.hidden_states(pixels)
        features = torch.cat([states[i] for i in self.feature_indices], dim=-1)
        if self.drop_class_token:
            features = features[:, 1:]
        return list(self.multi_modal_projector(features).to(table.dtype))


# Checkpoint prefixes (transformers 4's hub layout and 5's module names) -> ours.
_PREFIXES = (
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", ""),
    ("vision_tower.vision_model.", "vision_tower."),
)
_VISION_LAYER = re.compile(r"^vision_tower\.encoder\.layers\.(\d+)\.")
_UNUSED_VISION = re.compile(r"^vision_tower\.(post_layernorm|head)\.")


class LlavaFamily(ModelFamily):
    """Language model tensors go where Llama's do (q/k/v and gate/up fused); the vision tower's and projector's
    keep their names. Tower layers past the deepest feature layer, its post-norm and head are not loaded."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        name = renamed(name.removeprefix("model."), _PREFIXES)
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            return super().placement(name, cfg)
        layer = _VISION_LAYER.match(name)
        if _UNUSED_VISION.match(name) or (layer and int(layer.group(1)) >= max(cfg.feature_indices())):
            return None
        return Placement(name)


FAMILIES = {"LlavaForConditionalGeneration": LlavaFamily(LlavaArchConfig, LlavaForConditionalGeneration)}
