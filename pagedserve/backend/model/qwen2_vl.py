"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) and Qwen2-VL: the (windowed) vision transformer and patch merger of
`vision/qwen2_5_vit.py` beside a Qwen2 decoder whose rotary embedding is M-RoPE: a token has three positions
(time, row, column), each rotating its own section of the head's frequencies. Text tokens have three equal
positions; an image's tokens sit on its grid of merged patches from the position after the text before it, and
the text after an image resumes one past the image's largest position, so every later token's positions are its
index plus the sum of the earlier images' shifts (`mrope_positions`: a function of the request's images alone,
which decode, chunked prefill, preemption and prefix hits all recompute the same)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.vision.qwen2_5_vit import Qwen25VisionTransformer


@dataclass
class Qwen2VLArchConfig(ModelArchConfig):
    """Qwen2's decoder fields (from text_config, or the top level of a hub config.json), the vision config, the
    image token and M-RoPE's sections (frequencies per axis; they sum to head_dim / 2)."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    image_token_id: int = -1
    mrope_section: tuple[int, ...] = ()

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"})
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        section = tuple(int(s) for s in rope.pop("mrope_section", ()))
        if rope.get("rope_type", rope.get("type")) == "mrope":  # the hub's name for default rope with sections
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text["rope_parameters"] = {"rope_theta": text.get("rope_theta", 1_000_000.0), **rope}
        fields = super()._fields("Qwen2ForCausalLM", text)
        if sum(section) * 2 != fields["head_dim"]:
            raise UnsupportedModelError(f"mrope_section {list(section)} must sum to head_dim / 2 "
                                        f"({fields['head_dim'] // 2})")
        fields.update(architecture=arch, vision_config=dict(raw["vision_config"]), mrope_section=section,
                      image_token_id=int(raw.get("image_token_id", text.get("image_token_id", 151655))))
        return fields


def _image_grid(image: Any, merge: int) -> tuple[int, int, int]:
    """An image's grid of language-model tokens (frames, rows, columns of merged patches)."""
    t, h, w = (int(v) for v in image.data["image_grid_thw"].reshape(3).tolist())
    return t, h // merge, w // merge


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2's decoder with M-RoPE, the vision transformer beside it (`visual`)."""

    def __init__(self, cfg: Qwen2VLArchConfig, max_position: int):
        super().__init__(cfg, max_position)
        self.visual = Qwen25VisionTransformer(cfg.vision_config)
        self.merge = self.visual.merge
        self.mrope_axes = torch.empty(0, dtype=torch.int64)

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        """Qwen2's table, and which axis supplies each of its columns (cos half, then sin half)."""
        super().init_rope(dtype, device)
        axes = torch.cat([torch.full((size,), axis % 3) for axis, size in enumerate(self.config.mrope_section)])
        self.mrope_axes = torch.cat((axes, axes)).to(device)

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's merged tokens [t*h*w / 4, hidden], all images in one pass through the tower."""
        table = self.embed_tokens.weight  # (linears may be prepacked: the embedding table names device and dtype)
        grids = [tuple(int(v) for v in image["image_grid_thw"].reshape(3).tolist()) for image in images]
        pixels = torch.cat([image["pixel_values"] for image in images]).to(table.device)
        tokens = self.visual(pixels, grids).to(table.dtype)
        return list(tokens.split([t * h * w // self.merge**2 for t, h, w in grids]))

    def mrope_positions(self, images: Sequence[Any], start: int, count: int) -> torch.Tensor:
        """The three positions [3, count] of a request's tokens start .. start + count - 1; `images` are its
        ImageInputs (offset, length, data["image_grid_thw"]) in prompt order."""
        index = torch.arange(start, start + count)
        if all(image.end <= start for image in images):  # decode: every image behind, one shift for all axes
            shift = sum(max(_image_grid(image, self.merge)[1:]) - image.length for image in images)
            return (index + shift).expand(3, count)
        positions = index.expand(3, count).clone()
        shift = 0  # what the images so far moved the text after them by
        for image in images:
            t, h, w = _image_grid(image, self.merge)
            first, last = max(image.offset, start), min(image.end, start + count)
            if first < last:
                k = torch.arange(first - image.offset, last - image.offset)
                origin = image.offset + shift
                positions[:, first - start : last - start] = torch.stack(
                    (k // (h * w) + origin, k // w % h + origin, k % w + origin))
            shift += max(h, w) - image.length
            after = index >= image.end
            positions[:, after] = index[after] + shift
        return positions

    def rope_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain positions use the table as Qwen2 does; M-RoPE's [3, T] ones give each token its own row, mixed
        from its three positions' rows, read at index t."""
        if positions.dim() == 1:
            return positions, self.cos_sin_cache
        rows = self.cos_sin_cache[positions]  # [3, T, D]
        mixed = rows.gather(0, self.mrope_axes.view(1, 1, -1).expand(1, rows.shape[1], -1)).squeeze(0)
        return torch.arange(positions.shape[1], device=positions.device), mixed


_VISUAL = re.compile(r"^(model\.)?visual\.")


class Qwen2VLFamily(ModelFamily):
    """Decoder tensors go where Qwen2's do (hub names `model.layers.*`, transformers 5's
    `model.language_model.*`); the vision tower's keep their names under `visual.`."""

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        if _VISUAL.match(name):
            return Placement(_VISUAL.sub("visual.", name))
        name = name.removeprefix("model.").removeprefix("language_model.")
        return super().placement(name, cfg)


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL: the same decoder, M-RoPE and merger; its vision config (embed_dim) picks the tower without
    windows, LayerNorms and a two-layer MLP."""


FAMILIES = {
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLFamily(Qwen2VLArchConfig, Qwen2_5_VLForConditionalGeneration),
    "Qwen2VLForConditionalGeneration": Qwen2VLFamily(Qwen2VLArchConfig, Qwen2VLForConditionalGeneration),
}
