"""Gemma 3 (Gemma3ForConditionalGeneration): a SigLIP tower (post-normed last hidden states), a projector that
average-pools the patch grid down to mm_tokens_per_image tokens, (1 + weight) RMS-normalises them and multiplies
by mm_input_projection_weight, and Gemma 3's text decoder (gemma.py). The image rows replace the scaled text
embeddings unscaled. Each image's run of tokens attends bidirectionally within itself (transformers' token_type_ids
mask; in sliding layers still bounded by the window): the model says so with `bidirectional_image_runs`, the runner
hands the runs to attention and the scheduler never ends a prefill chunk inside one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement, renamed
from pagedserve.backend.model.gemma import Gemma3ArchConfig, Gemma3ForCausalLM
from pagedserve.backend.model.vision.siglip import SiglipVisionTower


@dataclass
class Gemma3VLArchConfig(Gemma3ArchConfig):
    """Gemma 3's text fields from text_config, the SigLIP config, the image token and tokens an image."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    image_token_id: int = -1
    mm_tokens_per_image: int = 256

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        text = dict(raw.get("text_config") or {})
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise UnsupportedModelError(f"text_config model_type {text.get('model_type')!r} is not supported in "
                                        f"{arch}; supported: gemma3_text")
        vision = dict(raw.get("vision_config") or {})
        if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise UnsupportedModelError(f"vision_config model_type {vision.get('model_type')!r} is not supported in "
                                        f"{arch}; supported: siglip_vision_model")
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
        for key in ("eos_token_id", "bos_token_id"):  # the hub's folders keep them at the top level
            if text.get(key) is None and raw.get(key) is not None:
                text[key] = raw[key]
        fields = super()._fields("Gemma3ForCausalLM", text)
        vision = {"image_size": 896, "patch_size": 14, "hidden_size": 1152, "intermediate_size": 4304,
                  "num_hidden_layers": 27, "num_attention_heads": 16, **vision}  # SiglipVisionConfig's defaults
        tokens = int(raw.get("mm_tokens_per_image", 256))
        patches, side = int(vision["image_size"]) // int(vision["patch_size"]), round(tokens**0.5)
        if side * side != tokens or patches % side:
            raise UnsupportedModelError(f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                                        f"vision tower's {patches} patches a side")
        fields.update(architecture=arch, vision_config=vision, mm_tokens_per_image=tokens,
                      image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 262_144))))
        return fields


class Gemma3VisionTower(SiglipVisionTower):
    """SiglipVisionModel's last_hidden_state: every encoder layer, then the post-norm (no pooling head)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg, int(cfg["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(int(cfg["hidden_size"]), eps=float(cfg.get("layer_norm_eps", 1e-6)))

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, H]
        return self.post_layernorm(self.hidden_states(pixel_values)[-1])


class Gemma3MultiModalProjector(nn.Module):
    """Average-pool the patch grid to side x side tokens, (1 + weight) RMS-norm them in fp32, project by a matmul."""

    def __init__(self, cfg: Gemma3VLArchConfig):
        super().__init__()
        vision = cfg.vision_config
        width = int(vision["hidden_size"])
        self.eps = float(vision.get("layer_norm_eps", 1e-6))
        self.patches = int(vision["image_size"]) // int(vision["patch_size"])
        self.kernel = self.patches // round(cfg.mm_tokens_per_image**0.5)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, cfg.hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(width))

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [N, P, H] -> [N, tokens, text hidden]
        n, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(n, hidden, self.patches, self.patches)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(x.type_as(pooled), self.mm_input_projection_weight).type_as(features)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's decoder with the SigLIP tower and projector beside it; an image's tokens attend to each other."""

    bidirectional_image_runs = True  # the runner builds attention's bidirectional ranges from the step's images

    def __init__(self, cfg: Gemma3VLArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.vision_tower = Gemma3VisionTower(cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's mm_tokens_per_image rows [tokens, hidden], in one batch (pixel_values [1, C, S, S] each)."""
        table = self.embed_tokens.weight  # (linears may be prepacked: the embedding table names device and dtype)
        pixels = torch.cat([image["pixel_values"] for image in images]).to(table.device)
        return list(self.multi_modal_projector(self.vision_tower.features(pixels)).to(table.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Gemma's scaled embeddings; an image token past the vocabulary reads row 0, as transformers does (the
        runner puts the image's rows there)."""
        vocab = self.config.vocab_size
        return super().embed(torch.where(input_ids < vocab, input_ids, 0))


# Checkpoint prefixes (the hub's layout, which transformers 5 also writes, and its module names) -> ours.
_PREFIXES = (
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", ""),
    ("vision_tower.vision_model.", "vision_tower."),
)


class Gemma3VLFamily(ModelFamily):
    """Decoder tensors go where Gemma 3's do (q/k/v and gate/up fused); the tower's and projector's keep their
    names; the tower's pooling head (vision_use_head) is not used."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        name = renamed(name.removeprefix("model."), _PREFIXES)
        if name.startswith("vision_tower.head."):
            return None
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return Placement(name)
        return super().placement(name, cfg)


FAMILIES = {"Gemma3ForConditionalGeneration": Gemma3VLFamily(Gemma3VLArchConfig, Gemma3ForConditionalGeneration)}
