"""Read and check a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) against the base
model it is to run on; every refusal is a LoRAAdapterError naming the adapter and the reason."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagedserve.backend.model.config import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Our fused projections and the PEFT target modules stacked along their output rows, in that order.
LORA_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# Also targets: a fused projection itself (Phi-3's checkpoints have qkv_proj and gate_up_proj), whose one A
# serves every part and whose B is cut by rows into the parts' B's.
TARGET_MODULES = tuple(m for parts in LORA_PROJECTIONS.values() for m in parts) + ("qkv_proj", "gate_up_proj")
# peft names tensors base_model.model.<module path>.lora_A.weight (the adapter's own name stripped on save).
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config fields whose non-default value asks for something these slots cannot compute.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out


class LoRAAdapterError(ValueError):
    """An adapter folder this base model cannot serve; the message names the adapter and why."""


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights on the host: `weights[(layer, module)] = (A [r, K], B [N, r])`, B with the scaling
    (alpha / r, or alpha / sqrt(r) under rsLoRA) folded in, fp32."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        """Host memory its tensors take."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT target module of one decoder layer of `arch`."""
    q, kv, h, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * inter),
    }


def load_lora_adapter(name: str, path: str | Path, arch: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in folder `path`, checked against `arch` and `max_rank`; LoRAAdapterError otherwise."""
    folder = Path(path)

    def refuse(reason: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r} ({path}): {reason}")

    if not folder.is_dir():
        raise refuse("no such folder")
    config = _read_config(folder, refuse)
    rank, alpha = _check_config(config, max_rank, refuse)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(folder, refuse)
    pairs = _pair_tensors(weights, arch, rank, refuse)
    adapter_weights = {key: (a, b * scaling) for key, (a, b) in pairs.items()}
    return LoRAAdapter(name, str(path), rank, scaling, adapter_weights)


def _read_config(folder: Path, refuse: Any) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise refuse(f"{CONFIG_FILE} is missing")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise refuse(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict[str, Any], max_rank: int, refuse: Any) -> tuple[int, float]:
    """(rank, alpha) of a plain LoRA config this engine serves."""
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over max_lora_rank ({max_rank})")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise refuse(f"bias {config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']} is not supported (whole trained modules)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise refuse(f"{what} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in TARGET_MODULES)
        if unknown:
            raise refuse(f"target modules {unknown} are not supported; supported: {', '.join(TARGET_MODULES)}")
    return rank, float(alpha)


def _read_weights(folder: Path, refuse: Any) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise refuse(f"{WEIGHTS_FILE} is missing")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key).float() for key in handle.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise refuse(f"{WEIGHTS_FILE} cannot be read: {error}") from None


def _pair_tensors(
    tensors: dict[str, torch.Tensor], arch: ModelArchConfig, rank: int, refuse: Any
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) by (layer, module), each shape checked against the base model's."""
    shapes = module_shapes(arch)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_NAME.search(key)
        if match is None:
            raise refuse(f"tensor {key!r} is not a LoRA A or B of a decoder projection (embedding, lm_head and "
                         "other modules are not supported)")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in shapes:
            raise refuse(f"target module {module!r} is not supported; supported: {', '.join(TARGET_MODULES)}")
        if layer >= arch.num_layers:
            raise refuse(f"tensor {key!r} is for layer {layer}, but the base model has {arch.num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA tensors")
    pairs = {}
    for (layer, module), half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            raise refuse(f"layers.{layer}.{module} has lora_{'A' if 'A' in half else 'B'} but not its pair")
        in_features, out_features = shapes[module]
        a, b = half["A"], half["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise refuse(
                f"layers.{layer}.{module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but rank {rank} on this "
                f"base model needs A {(rank, in_features)} and B {(out_features, rank)} (an adapter of another model?)"
            )
        if module in LORA_PROJECTIONS and len(LORA_PROJECTIONS[module]) > 1:
            _split_fused(pairs, layer, module, a, b, shapes, refuse)
        elif (layer, module) in pairs:
            raise refuse(f"layers.{layer}.{module} has LoRA weights of its own and of its fused projection")
        else:
            pairs[(layer, module)] = (a.contiguous(), b.contiguous())
    return pairs


def _split_fused(pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], layer: int, module: str,
                 a: torch.Tensor, b: torch.Tensor, shapes: dict[str, tuple[int, int]], refuse: Any) -> None:
    """A fused projection's (A, B) as its parts': the same A, B's rows cut at the parts' sizes."""
    parts = LORA_PROJECTIONS[module]
    if any((layer, part) in pairs for part in parts):
        raise refuse(f"layers.{layer} has LoRA weights for both {module} and its parts {', '.join(parts)}")
    rows = b.split([shapes[part][1] for part in parts])
    for part, b_part in zip(parts, rows, strict=True):
        pairs[(layer, part)] = (a.contiguous(), b_part.contiguous())
