"""LLaVA's model half against transformers: the config read from text_config / vision_config, the checkpoint
placed (hub and transformers 5 names), and image embeddings equal to get_image_features for CLIP and SigLIP
towers, one and several feature layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError, load_model
from pagedserve.backend.model.llava import LlavaFamily
from pagedserve.testing import make_tiny_llava, tiny_image


@pytest.fixture(scope="module")
def llava_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "clip": make_tiny_llava(tmp_path_factory.mktemp("llava-clip"), "clip"),
        "siglip": make_tiny_llava(tmp_path_factory.mktemp("llava-siglip"), "siglip", seed=1),
        "clip-layers": make_tiny_llava(tmp_path_factory.mktemp("llava-layers"), "clip", vision_feature_layer=[-3, -1],
                                       seed=2),
    }


@pytest.mark.parametrize("kind", ["clip", "siglip", "clip-layers"])
def test_image_embeddings_equal_transformers_get_image_features(llava_paths: dict[str, Path], kind: str) -> None:
    path = llava_paths[kind]
    processor = transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
    images = [tiny_image(40, 30), tiny_image(20, 50, seed=1), tiny_image(28, 28, seed=2)]
    pixels = processor(text="<image>" * 3, images=images, return_tensors="pt")["pixel_values"]
    ref = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    ours = load_model(path, torch.float32, torch.device("cpu"), 256)
    with torch.no_grad():
        expected = ref.get_image_features(pixels, vision_feature_layer=ref.config.vision_feature_layer,
                                          vision_feature_select_strategy=ref.config.vision_feature_select_strategy)
        got = ours.encode_images([{"pixel_values": pixels[i : i + 1]} for i in range(3)])
    assert len(got) == 3
    for mine, theirs in zip(got, expected.pooler_output, strict=True):
        assert mine.shape == (16, 64)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # The images differ, so their embeddings must too (a tower that ignored its input would pass the above).
    assert not torch.allclose(got[0], got[1])


def test_config_reads_text_and_vision_configs(llava_paths: dict[str, Path]) -> None:
    cfg = ModelArchConfig.from_pretrained(llava_paths["clip-layers"])
    assert cfg.architecture == "LlavaForConditionalGeneration"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (64, 2, 2)
    assert cfg.vision_feature_layers == (-3, -1)
    assert cfg.feature_indices() == [1, 3]
    assert cfg.image_token_id == 384


def test_tower_layers_past_the_feature_layer_are_not_built(llava_paths: dict[str, Path]) -> None:
    model = load_model(llava_paths["clip"], torch.float32, torch.device("cpu"), 256)
    assert len(model.vision_tower.encoder.layers) == 2  # feature layer -2 of 3: the third is never read
    family = LlavaFamily(type(model.config), type(model))
    assert family.placement("vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight", model.config) is None
    assert family.placement("vision_tower.vision_model.post_layernorm.weight", model.config) is None
    placed = family.placement("language_model.model.layers.0.self_attn.k_proj.weight", model.config)
    assert placed.param == "layers.0.self_attn.qkv_proj.weight" and placed.selector == (slice(64, 96),)
    assert family.placement("model.language_model.norm.weight", model.config).param == "norm.weight"
    assert family.placement("language_model.lm_head.weight", model.config).param == "lm_head.weight"


def test_unsupported_select_strategy_is_refused_naming_it(llava_paths: dict[str, Path]) -> None:
    import json

    raw = json.loads((llava_paths["clip"] / "config.json").read_text())
    raw["vision_feature_select_strategy"] = "pooled"
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy"):
        ModelArchConfig.from_dict(raw)
