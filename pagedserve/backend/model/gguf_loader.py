"""Build the model of the file's family (llama, qwen2, qwen3, phi3, gemma2, gemma3; the MoE qwen2moe, qwen3moe and
Mixtral stored as llama) from a GGUF file without dequantizing it: quantized tensors become QuantizedLinear /
QuantizedEmbedding layers (quantized experts QuantizedExperts) holding the file's own integers and scales; float
tensors load as they are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.gguf_file import GGUFError
from pagedserve.backend.model.moe import QuantizedExperts, SparseMoeBlock
from pagedserve.backend.model.quantized import QuantizedEmbedding, QuantizedLinear, prepare_quantized
from pagedserve.backend.model.registry import family_for
from pagedserve.kernels.quant_linear import QuantizedWeight
from pagedserve.kernels.quant_linear.layout import concat_rows, select_rows

Loaded = QuantizedWeight | torch.Tensor
# Our linear layer -> the GGUF tensors (per layer) stacked along its rows, the first alternative whose tensors the
# file has (Phi-3's converter keeps qkv and gate_up fused, as attn_qkv and ffn_up).
_LINEARS = {
    "self_attn.qkv_proj": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
    "self_attn.o_proj": (("attn_output",),),
    "mlp.gate_up_proj": (("ffn_gate", "ffn_up"), ("ffn_up",)),
    "mlp.down_proj": (("ffn_down",),),
}
# Our norms -> the GGUF tensors: Llama's two, or Gemma's four; Q/K head norms where the family has them.
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_HEAD_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# The metadata keys (after the architecture's prefix) that decide every weight's shape.
_SHAPE_KEYS = ("embedding_length, feed_forward_length, attention.head_count, attention.head_count_kv, "
               "attention.key_length, vocab_size")
_EXPERT_KEYS = "embedding_length, expert_count, expert_feed_forward_length"


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int) -> nn.Module:
    """The model with every weight from the GGUF file at `path`; every tensor of the file must find its place."""
    cfg = ModelArchConfig.from_pretrained(path)
    with torch.device("meta"):
        model = family_for(cfg.architecture).model_cls(cfg, max_position)
    model = model.to_empty(device=device).to(dtype)
    source = _Source(path, cfg)
    norms = _GEMMA_NORMS if source.gemma else _NORMS
    for i, layer in enumerate(model.layers):
        moe = isinstance(layer.mlp, SparseMoeBlock)
        if moe:
            _set_moe(layer.mlp, source, i, dtype, device)
        for target, alternatives in _LINEARS.items():
            parent, name = target.split(".")
            if moe and parent == "mlp":
                continue
            names = source.first_present(i, alternatives)
            _set_linear(getattr(layer, parent), name, source.rows(names), source.bias(names), dtype, device,
                        [f"{n}.weight" for n in names])
        for ours, theirs in {**norms, **_HEAD_NORMS}.items():
            if ours in _HEAD_NORMS and not hasattr(layer.self_attn, ours.split(".")[1]):
                continue
            weight_name = f"blk.{i}.{theirs}.weight"
            _copy(layer.get_submodule(ours).weight, source.norm(weight_name), weight_name)
    model.norm.weight.data.copy_(source.norm("output_norm.weight"))
    _set_embeddings(model, source, cfg, dtype, device)
    config_tensors = (*gguf_file.LONGROPE_TENSORS, gguf_file.ROPE_FREQS_TENSOR)  # read into the config
    source.used.update(name for name in config_tensors if name in source.tensors)
    source.check_all_used()
    prepare_quantized(model)
    model.init_rope(dtype, device)
    model.eval()
    return model


class _Source:
    """The file's tensors, unpacked on request, with Q/K rows put back in Hugging Face order."""

    def __init__(self, path: str | Path, cfg: ModelArchConfig):
        self.path, self.cfg = path, cfg
        self.tensors = gguf_file.tensors(path)
        arch = gguf_file.architecture(path)
        self.permuted, self.gemma = arch.permuted, arch.gemma
        self.used: set[str] = set()

    def first_present(self, layer: int, alternatives: tuple[tuple[str, ...], ...]) -> list[str]:
        """Layer `layer`'s tensor names of the first alternative the file holds (else the first, to be refused)."""
        for parts in alternatives:
            names = [f"blk.{layer}.{part}" for part in parts]
            if all(f"{name}.weight" in self.tensors for name in names):
                return names
        return [f"blk.{layer}.{part}" for part in alternatives[0]]

    def norm(self, name: str) -> torch.Tensor:
        """A norm's weight as our families hold it: llama.cpp stores Gemma's (1 + weight) whole."""
        weight = self.float(name)
        return weight - 1 if self.gemma else weight

    def get(self, name: str) -> Loaded:
        if name not in self.tensors:
            raise GGUFError(f"GGUF file {str(self.path)!r} has no tensor {name!r}")
        self.used.add(name)
        loaded = gguf_file.unpack(self.tensors[name])
        key = {"attn_q": "head_count", "attn_k": "head_count_kv"}.get(name.split(".")[-2])
        if self.permuted and key:
            heads = self.cfg.num_heads if key == "head_count" else self.cfg.num_kv_heads
            count = loaded.shape[0] if isinstance(loaded, torch.Tensor) else loaded.out_features
            if count % (2 * heads):
                raise GGUFError(f"GGUF tensor {name!r} has {count} rows, which the metadata's attention.{key} "
                                f"({heads}) does not split into heads of whole rotary pairs")
            rows = _unpermute_rows(count, heads)
            loaded = loaded[rows] if isinstance(loaded, torch.Tensor) else select_rows(loaded, rows)
        return loaded

    def experts(self, layer: int, part: str, count: int) -> list[Loaded]:
        """Layer `layer`'s `part` (gate, up, down) projection of every expert: the stacked ffn_{part}_exps, or the
        per-expert ffn_{part}.{e} tensors of early (2023) Mixtral files."""
        name = f"blk.{layer}.ffn_{part}_exps.weight"
        if name not in self.tensors and f"blk.{layer}.ffn_{part}.0.weight" in self.tensors:
            return [self.get(f"blk.{layer}.ffn_{part}.{e}.weight") for e in range(count)]
        if name not in self.tensors:
            raise GGUFError(f"GGUF file {str(self.path)!r} has no tensor {name!r}")
        self.used.add(name)
        return gguf_file.unpack_experts(self.tensors[name])

    def float(self, name: str) -> torch.Tensor:
        loaded = self.get(name)
        return loaded if isinstance(loaded, torch.Tensor) else loaded.dequantize()

    def rows(self, names: list[str]) -> Loaded:
        """The named weights stacked along their rows: one QuantizedWeight when all are quantized."""
        parts = [self.get(f"{name}.weight") for name in names]
        widths = {p.shape[1] if isinstance(p, torch.Tensor) else p.in_features for p in parts}
        if len(widths) > 1:
            raise GGUFError(f"GGUF tensors {[f'{name}.weight' for name in names]} have different widths {widths}")
        if all(isinstance(p, QuantizedWeight) for p in parts):
            return parts[0] if len(parts) == 1 else concat_rows(parts)
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])

    def bias(self, names: list[str]) -> torch.Tensor | None:
        present = [f"{name}.bias" for name in names if f"{name}.bias" in self.tensors]
        if not present:
            return None
        if len(present) != len(names):
            raise GGUFError(f"GGUF file {str(self.path)!r} has biases for only some of {names}")
        return torch.cat([self.float(name) for name in present])

    def check_all_used(self) -> None:
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            raise GGUFError(f"GGUF file {str(self.path)!r} has {len(unused)} tensors pagedserve does not use, "
                            f"e.g. {unused[:3]}")


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's per-head interleave of the rotary halves (as transformers undoes it)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _set_linear(parent: nn.Module, name: str, weight: Loaded, bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device, tensors: list[str]) -> None:
    """Fill the nn.Linear `parent.name` with a float weight, or put a QuantizedLinear in its place; `tensors` are
    the GGUF tensors stacked into it (named when their shape contradicts the metadata)."""
    linear: nn.Linear = getattr(parent, name)
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    shape = _shape_of(weight)
    if shape != tuple(linear.weight.shape):
        raise GGUFError(f"GGUF tensors {', '.join(map(repr, tensors))} stack to shape {shape}, but the file's "
                        f"metadata ({_SHAPE_KEYS}) gives {tuple(linear.weight.shape)}")
    if isinstance(weight, torch.Tensor):
        linear.weight.data.copy_(weight)
        if bias is not None:
            linear.bias.data.copy_(bias)
        return
    setattr(parent, name, QuantizedLinear(weight.to(device), bias))


def _set_moe(block: SparseMoeBlock, source: _Source, i: int, dtype: torch.dtype, device: torch.device) -> None:
    """Layer i's router, experts and Qwen2-MoE's shared expert with its gate."""
    router = f"blk.{i}.ffn_gate_inp"
    _set_linear(block, "gate", source.rows([router]), None, dtype, device, [f"{router}.weight"])
    count = block.experts.w13.shape[0]
    _set_experts(block, [source.experts(i, part, count) for part in ("gate", "up", "down")], i, device)
    if block.shared_expert is not None:
        shared = [f"blk.{i}.ffn_{part}_shexp" for part in ("gate", "up", "down")]
        _set_linear(block.shared_expert, "gate_up_proj", source.rows(shared[:2]), None, dtype, device,
                    [f"{name}.weight" for name in shared[:2]])
        _set_linear(block.shared_expert, "down_proj", source.rows(shared[2:]), None, dtype, device,
                    [f"{shared[2]}.weight"])
        name = f"blk.{i}.ffn_gate_inp_shexp.weight"  # llama.cpp holds it as a vector
        _copy(block.shared_expert_gate.weight, source.float(name).reshape(1, -1), name)


def _set_experts(block: SparseMoeBlock, stacks: list[list[Loaded]], i: int, device: torch.device) -> None:
    """The gate, up and down stacks (one weight per expert) as QuantizedExperts when all are quantized, else
    (dequantized where needed) into the block's float stacks."""
    experts, twice_inter, hidden = block.experts.w13.shape
    wants = ((experts, twice_inter // 2, hidden),) * 2 + ((experts, hidden, twice_inter // 2),)
    for part, loaded, want in zip(("gate", "up", "down"), stacks, wants, strict=True):
        shape = (len(loaded), *_shape_of(loaded[0]))
        if shape != want:
            raise GGUFError(f"GGUF tensor 'blk.{i}.ffn_{part}_exps.weight' has shape {shape}, but the file's "
                            f"metadata ({_EXPERT_KEYS}) gives {want}")
    gate, up, down = stacks
    if all(isinstance(p, QuantizedWeight) for p in (*gate, *up, *down)):
        w13 = [QuantizedLinear(concat_rows([g, u]).to(device)) for g, u in zip(gate, up, strict=True)]
        block.experts = QuantizedExperts(w13, [QuantizedLinear(d.to(device)) for d in down])
        return
    floats = [torch.stack([p if isinstance(p, torch.Tensor) else p.dequantize() for p in part]) for part in stacks]
    block.experts.w13.data.copy_(torch.cat(floats[:2], dim=1))
    block.experts.w2.data.copy_(floats[2])


def _set_embeddings(model: nn.Module, source: _Source, cfg: ModelArchConfig, dtype: torch.dtype,
                    device: torch.device) -> None:
    """The token table (quantized or not) and the lm_head: its own `output.weight`, or the tied table."""
    table = source.get("token_embd.weight")
    if isinstance(table, QuantizedWeight):
        _check_shape(model.embed_tokens.weight, table, "token_embd.weight")
        table = table.to(device)
        model.embed_tokens = QuantizedEmbedding(table, dtype)
    else:
        _copy(model.embed_tokens.weight, table, "token_embd.weight")
    head: Any = table if cfg.tie_word_embeddings else source.get("output.weight")
    if isinstance(head, QuantizedWeight):
        _check_shape(model.lm_head.weight, head, "output.weight")
        model.lm_head = QuantizedLinear(head.to(device))
    elif cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        _copy(model.lm_head.weight, head, "output.weight")


def _shape_of(tensor: Loaded) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else (tensor.out_features, tensor.in_features)


def _check_shape(param: torch.Tensor, tensor: Loaded, name: str) -> None:
    shape = _shape_of(tensor)
    if shape != tuple(param.shape):
        raise GGUFError(f"GGUF tensor {name!r} has shape {shape}, but the file's metadata ({_SHAPE_KEYS}) gives "
                        f"{tuple(param.shape)}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    _check_shape(param, tensor, name)
    param.data.copy_(tensor)
