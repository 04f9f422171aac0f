"""Load a Llama-family checkpoint (config.json + safetensors, single or sharded) and its tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.family import ModelFamily, Selector
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.kv_scales import KVScales, apply_kv_scales, take_kv_scale
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.quant_formats import Scheme, scheme_from_config
from pagedserve.backend.model.quantized import QuantizedLinear, prepare_quantized, quantize_projections
from pagedserve.backend.model.registry import family_for
from pagedserve.kernels.quant_linear.layout import concat_rows

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    family = family_for(cfg.architecture)
    scheme = scheme_from_config(json.loads((path / "config.json").read_text()))
    if scheme is not None and quantization != "none":
        raise ValueError(f"quantization {quantization!r} applies to float checkpoints; this one is already "
                         f"quantized ({scheme.method})")
    model = empty_model(family, cfg, max_position, dtype, device)
    stash: dict[str, dict[str, torch.Tensor]] = {}
    filled = place_checkpoint(model, family, cfg, _set_aside(iter_checkpoint(path), scheme, stash))
    if scheme is not None:
        _place_quantized(model, family, cfg, scheme, stash, filled)
    check_complete(model, filled)
    quantize_projections(model, quantization)
    prepare_quantized(model)
    model.init_rope(dtype, device)
    model.eval()
    return model


# Parameter name -> the selectors filled so far and how many elements each filled.
Filled = dict[str, dict[str, int]]


def empty_model(family: ModelFamily, cfg: ModelArchConfig, max_position: int, dtype: torch.dtype,
                device: torch.device, reshape: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The family's model for `cfg` on `device`, its memory not yet filled; `reshape` edits it first, on the meta
    device (a rank's vocabulary rows). A tied lm_head shares the embedding's table."""
    with torch.device("meta"):
        model = family.model_cls(cfg, max_position)
        if reshape is not None:
            reshape(model)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def place_checkpoint(model: nn.Module, family: ModelFamily, cfg: ModelArchConfig,
                     tensors: Iterable[tuple[str, torch.Tensor]],
                     shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Filled:
    """Copy each checkpoint tensor (through `shard`: this rank's slice of it) into the part of its parameter the
    family names; returns what was filled, a tied lm_head counted. An fp8-KV checkpoint's K/V scales go to the
    attention layers (the same on every rank: one per tensor)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: Filled = {}
    kv_scales: KVScales = {}
    for name, tensor in tensors:
        if take_kv_scale(name, tensor, kv_scales):
            continue
        placement = family.placement(name, cfg)
        if placement is None:
            continue
        if placement.param not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
        dst = params[placement.param].data
        if placement.selector is not None:
            dst = dst[placement.selector]
        if shard is not None:
            tensor = shard(name, tensor)
        if dst.shape != tensor.shape:
            part = " (this rank's shard)" if shard is not None else ""
            raise ValueError(f"checkpoint tensor {name!r}{part} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        _mark(filled, placement.param, placement.selector, dst.numel())
    if cfg.tie_word_embeddings:
        _mark(filled, "lm_head.weight", None, model.lm_head.weight.numel())
    apply_kv_scales(model, kv_scales)
    return filled


def _set_aside(tensors: Iterable[tuple[str, torch.Tensor]], scheme: Scheme | None,
               stash: dict[str, dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `scheme` does not own; the quantized ones it owns go into `stash`, by checkpoint module then
    suffix."""
    for name, tensor in tensors:
        if scheme is not None and scheme.owns(name):
            module, suffix = name.rsplit(".", 1)
            stash.setdefault(module, {})[suffix] = tensor
        else:
            yield name, tensor


def _mark(filled: Filled, param: str, selector: Selector | None, numel: int) -> None:
    """Record that `selector` of `param` (None: all of it) was filled with `numel` elements."""
    filled.setdefault(param, {})[_selector_text(selector)] = numel


def _selector_text(selector: Selector | None) -> str:
    """`[a:b]`, `[e, a:b]`, or '' for the whole parameter."""
    if selector is None:
        return ""
    parts = [f"{s.start or 0}:{s.stop}" if isinstance(s, slice) else str(s) for s in selector]
    return f"[{', '.join(parts)}]"


def _place_quantized(model: LlamaForCausalLM, family: ModelFamily, cfg: ModelArchConfig, scheme: Scheme,
                     stash: dict[str, dict[str, torch.Tensor]], filled: Filled) -> None:
    """Each quantized projection (fused parts concatenated by rows) becomes a QuantizedLinear on the model's
    device, keeping the bias already loaded."""
    device = model.norm.weight.device
    groups: dict[str, list[str | None]] = {}
    for module in sorted(stash):
        target, index, count = family.module_target(module)
        groups.setdefault(target, [None] * count)[index or 0] = module
    for target, modules in groups.items():
        names = [m if m is not None else _sibling(family, target, i) for i, m in enumerate(modules)]
        weights = [scheme.to_weight(stash.pop(name) if name in stash else {}, name) for name in names]
        weight = weights[0] if len(weights) == 1 else concat_rows(weights)
        parent_name, _, attr = target.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
        except AttributeError:
            parent = None
        old = getattr(parent, attr, None)
        if not isinstance(old, nn.Linear | QuantizedLinear):
            raise ValueError(f"quantized checkpoint tensors have no place in {cfg.architecture}: {names[0]!r}")
        if (weight.out_features, weight.in_features) != (old.out_features, old.in_features):
            raise ValueError(f"quantized {target} has shape {(weight.out_features, weight.in_features)}, expected "
                             f"{(old.out_features, old.in_features)}")
        setattr(parent, attr, QuantizedLinear(weight.to(device), old.bias))
        _mark(filled, f"{target}.weight", None, old.out_features * old.in_features)


def _sibling(family: ModelFamily, target: str, index: int) -> str:
    """The checkpoint module holding piece `index` of our fused `target` (named to say what is missing)."""
    parent, _, fused = target.rpartition(".")
    return f"model.{parent}.{family.fused[fused].parts[index]}"


def check_complete(model: LlamaForCausalLM, filled: Filled) -> None:
    """Every element of every parameter must have come from the checkpoint: the parts filled of each parameter
    add up to all of it."""
    missing = []
    for name, param in model.named_parameters():
        parts = filled.get(name, {})
        if sum(parts.values()) != param.numel():
            done = ", ".join(p for p in sorted(parts) if p) or "none"
            missing.append(f"{name} (parts filled: {done})" if parts else name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
