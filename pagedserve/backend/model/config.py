"""The architecture fields pagedserve reads from a Hugging Face config.json, normalised across versions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pagedserve.backend.model.registry import SUPPORTED_ARCHITECTURES, UnsupportedModelError, family_for

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArchConfig", "UnsupportedModelError"]


@dataclass(slots=True)
class ModelArchConfig:
    """Shapes and numerics of a Llama-family decoder. A family with keys of its own subclasses it (more fields,
    `_fields` reading them, its own HIDDEN_ACTS / ROPE_TYPES); `from_dict` builds the family's class."""

    HIDDEN_ACTS: ClassVar[tuple[str, ...]] = ("silu",)
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "llama3", "linear")

    architecture: str
    hidden_act: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Per layer, whether it attends through sliding_window (config.json's layer_types); (): every layer does.
    sliding_layers: tuple[bool, ...] = ()

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`'s attention; None where it attends to its whole context."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer_idx]):
            return None
        return self.sliding_window

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelArchConfig:
        """Parse a config.json dict into its family's config class; unsupported architectures, activations and
        rope types raise UnsupportedModelError."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else str(raw.get("model_type", "<missing>"))
        config_cls = family_for(arch).config_cls
        return config_cls(**config_cls._fields(arch, raw))

    @classmethod
    def _fields(cls, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        """The constructor's keyword arguments read from `raw`; a family's override adds its own."""
        act = raw.get("hidden_act", "silu")
        if act not in cls.HIDDEN_ACTS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {', '.join(cls.HIDDEN_ACTS)}")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_theta, rope_scaling = _rope(raw, cls.ROPE_TYPES)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        sliding = raw.get("sliding_window")
        if is_qwen2 and not raw.get("use_sliding_window", False):
            sliding = None
        eos = raw.get("eos_token_id")
        num_layers = int(raw["num_hidden_layers"])
        return dict(
            architecture=arch,
            hidden_act=act,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_ids=_as_ids(eos),
            bos_token_id=raw.get("bos_token_id"),
            sliding_layers=sliding_layers(raw, num_layers),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelArchConfig:
        """Read `path/config.json`, or a .gguf file's metadata."""
        if str(path).endswith(".gguf"):
            from pagedserve.backend.model import gguf_file

            return cls.from_dict(gguf_file.config_dict(path))
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(path)!r}")
        return cls.from_dict(json.loads(config_file.read_text()))


def sliding_layers(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers slide: config.json's layer_types, or (Qwen2, Qwen3 without them) those from max_window_layers
    on; () where neither is given, every layer then taking the model's sliding_window."""
    types = raw.get("layer_types")
    if types is None and "max_window_layers" in raw:
        return tuple(i >= int(raw["max_window_layers"]) for i in range(num_layers))
    if types is None:
        return ()
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types must be {num_layers} of sliding_attention / full_attention; "
                                    f"got {len(types)} with {unknown or 'no'} other types")
    return tuple(t == "sliding_attention" for t in types)


def _rope(raw: dict[str, Any], supported: tuple[str, ...]) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from transformers 5 `rope_parameters` or 4.x top-level keys."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type not in supported:
        raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(supported)}")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _as_ids(value: Any) -> tuple[int, ...]:
    """An eos id field (int, list or None) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
