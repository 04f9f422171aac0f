"""Vision towers of the vision-language families (CLIP, SigLIP): a patch embedding and a pre-norm transformer
encoder run over whole images, batched; `vision_tower_for` builds the one a vision_config names."""

from __future__ import annotations

from typing import Any

from pagedserve.backend.model.config import UnsupportedModelError
from pagedserve.backend.model.vision.clip import CLIPVisionTower
from pagedserve.backend.model.vision.encoder import VisionTower
from pagedserve.backend.model.vision.siglip import SiglipVisionTower

_TOWERS: dict[str, type[VisionTower]] = {
    "clip_vision_model": CLIPVisionTower,
    "siglip_vision_model": SiglipVisionTower,
}


def vision_tower_for(vision_config: dict[str, Any], num_layers: int) -> VisionTower:
    """The tower of `vision_config` (its model_type) with its first `num_layers` encoder layers."""
    model_type = vision_config.get("model_type", "clip_vision_model")
    if model_type not in _TOWERS:
        raise UnsupportedModelError(f"vision_config model_type {model_type!r} is not supported; supported: "
                                    f"{', '.join(sorted(_TOWERS))}")
    return _TOWERS[model_type](vision_config, num_layers)


__all__ = ["CLIPVisionTower", "SiglipVisionTower", "VisionTower", "vision_tower_for"]
