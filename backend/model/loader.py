"""Load a Llama-family checkpoint (config.json + safetensors, single or sharded) and its tokenizer."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.quant_formats import Scheme, scheme_from_config
from pagedserve.backend.model.quantized import QuantizedLinear, prepare_quantized, quantize_projections
from pagedserve.kernels.quant_linear.layout import concat_rows
from safetensors import safe_open

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint projections that land in a slice of one of our fused parameters.
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Our fused projections -> the checkpoint modules stacked along their rows.
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def resolve_dtype(dtype: str, cfg: ModelArchConfig) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (float32 when it names none)."""
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in _DTYPES else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int, quantization: str = "none"
) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` with every weight read from the safetensors files; `quantization`
    int8 / int4 then quantizes the decoder's projections (QuantizedLinear). A .gguf file loads as it is stored."""
    if str(path).endswith(".gguf"):
        if quantization != "none":
            raise ValueError(f"quantization {quantization!r} applies to float checkpoints; a GGUF file is served "
                             "with its own quantization")
        return load_gguf_model(path, dtype, device, max_position)
    path = Path(path)
    cfg = ModelArchConfig.from_pretrained(path)
    scheme = scheme_from_config(json.loads((path / "config.json").read_text()))
    if scheme is not None and quantization != "none":
        raise ValueError(f"quantization {quantization!r} applies to float checkpoints; this one is already "
                         f"quantized ({scheme.method})")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    loaded, stash = _load_tensors(model, cfg, path, scheme)
    if scheme is not None:
        _place_quantized(model, cfg, scheme, stash)
    _check_complete(model, cfg, loaded)
    quantize_projections(model, quantization)
    prepare_quantized(model)
    model.init_rope(dtype, device)
    model.eval()
    return model


def _load_tensors(model: LlamaForCausalLM, cfg: ModelArchConfig, path: Path,
                  scheme: Scheme | None) -> tuple[set[str], dict[str, dict[str, torch.Tensor]]]:
    """Copy every float tensor into its parameter (or its slice of a fused one); returns the names filled and
    the quantized projections' tensors, by checkpoint module then suffix."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    stash: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _iter_checkpoint(path):
        if _IGNORED.search(name):
            continue
        if scheme is not None and scheme.owns(name):
            module, suffix = name.rsplit(".", 1)
            stash.setdefault(module, {})[suffix] = tensor
            continue
        target, rows = _target(name, cfg)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
        param = params[target]
        dst = param.data if rows is None else param.data[rows[0] : rows[1]]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        loaded.add(target if rows is None else f"{target}[{rows[0]}:{rows[1]}]")
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")
    return loaded, stash


def _place_quantized(model: LlamaForCausalLM, cfg: ModelArchConfig, scheme: Scheme,
                     stash: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each quantized projection (fused parts concatenated by rows) becomes a QuantizedLinear on the model's
    device, keeping the bias already loaded."""
    device = model.norm.weight.device
    targets = {"lm_head": ["lm_head"]}
    for i in range(cfg.num_layers):
        for fused, parts in _FUSED_PARTS.items():
            targets[f"layers.{i}.{fused}"] = [f"layers.{i}.{part}" for part in parts]
    for target, parts in targets.items():
        names = [next((k for k in (f"model.{p}", p) if k in stash), f"model.{p}") for p in parts]
        if not any(name in stash for name in names):
            continue
        weights = [scheme.to_weight(stash.pop(name) if name in stash else {}, name) for name in names]
        weight = weights[0] if len(weights) == 1 else concat_rows(weights)
        parent_name, _, attr = target.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if (weight.out_features, weight.in_features) != (old.out_features, old.in_features):
            raise ValueError(f"quantized {target} has shape {(weight.out_features, weight.in_features)}, expected "
                             f"{(old.out_features, old.in_features)}")
        setattr(parent, attr, QuantizedLinear(weight.to(device), old.bias))
    if stash:
        raise ValueError(f"quantized checkpoint tensors have no place in {cfg.architecture}: {sorted(stash)[:3]}")


def _target(name: str, cfg: ModelArchConfig) -> tuple[str, tuple[int, int] | None]:
    """Our parameter name for a checkpoint tensor, and the row range it fills in a fused parameter."""
    name = name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) >= 4 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        sizes = _fused_sizes(fused, cfg)
        start = sum(sizes[:index])
        return ".".join([*parts[:-2], fused, parts[-1]]), (start, start + sizes[index])
    return name, None


def _fused_sizes(fused: str, cfg: ModelArchConfig) -> list[int]:
    """Row sizes of the pieces concatenated in a fused parameter."""
    if fused == "qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _check_complete(model: LlamaForCausalLM, cfg: ModelArchConfig, loaded: set[str]) -> None:
    """Every parameter (and every slice of a fused one) must have come from the checkpoint."""
    missing = []
    for name, _ in model.named_parameters():
        fused = name.split(".")[-2] if name.count(".") >= 2 else ""
        if fused in ("qkv_proj", "gate_up_proj"):
            sizes = _fused_sizes(fused, cfg)
            bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
            missing += [f"{name}[{a}:{b}]" for a, b in bounds if f"{name}[{a}:{b}]" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def _iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in model folder {str(path)!r}")
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's fast tokenizer (tokenizer.json, chat template included), from local files only; a GGUF
    file's own vocabulary, merges and chat template."""
    from transformers import AutoTokenizer

    if str(path).endswith(".gguf"):
        path = Path(path)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_eos_token_ids(path: str | Path, cfg: ModelArchConfig, tokenizer: Any) -> set[int]:
    """All eos ids: generation_config.json's, config.json's and the tokenizer's own eos token."""
    ids = set(cfg.eos_token_ids)
    gen_file = Path(path) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
