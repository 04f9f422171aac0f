"""Tensor-parallel shards of a decoder: each rank's config (its share of the heads, of the MLP and of every
expert's width) and its slices of the checkpoint (Megatron's split: column-parallel q/k/v and gate/up, row-parallel
o_proj and down_proj; each expert's gate/up (w1/w3) column-parallel and its down (w2) row-parallel, a shared expert
split as a dense MLP, the router and the shared expert's gate replicated; a vocab-parallel embedding and lm_head
holding rows [rank * Vp, (rank + 1) * Vp) of the vocabulary, Vp = ceil(vocab / ranks), zero past its end; the norms
replicated). The layers that join the ranks' partial results over a group are parallel_layers.py's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from pagedserve.backend.model.config import ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import gate_up_sizes, qkv_sizes
from pagedserve.backend.model.loader import check_complete, empty_model, iter_checkpoint, place_checkpoint
from pagedserve.backend.model.moe import MoEArchConfig
from pagedserve.backend.model.quant_formats import scheme_from_config
from pagedserve.backend.model.registry import family_for

# Families whose layers take every size from the config, with nothing per head but head_dim-wide norms (Qwen3's
# and Gemma 3's q/k norms): their sharded config builds a rank's slice.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Checkpoint modules split by output rows (Mixtral's experts name gate / up w1 / w3) ...
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
KV_PROJECTIONS = ("k_proj", "v_proj")
# ... and by input columns (Mixtral's expert down: w2), their outputs summed over the ranks.
ROW_PARALLEL_CHECKPOINT = ("o_proj", "down_proj", "w2")
ROW_PARALLEL = ("o_proj", "down_proj")  # our modules whose outputs the ranks sum (and the MoE blocks)
VOCAB_PARALLEL = ("embed_tokens", "lm_head")  # split by vocabulary rows


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    """Vp: the vocabulary rows each rank holds (the last ones padded with zeros past the vocabulary)."""
    return -(-vocab_size // world_size)


def indivisible_field(cfg: ModelArchConfig, world_size: int) -> tuple[str, int] | None:
    """(config.json field, its value) of the first size `world_size` ranks cannot split evenly; None if none.
    Fewer KV heads than ranks are replicated when their number divides the ranks' (as vLLM does)."""
    sizes = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
             ("intermediate_size", cfg.intermediate_size)]
    if isinstance(cfg, MoEArchConfig):
        sizes += [("moe_intermediate_size", cfg.moe_intermediate_size),
                  ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)]
    for field, value in sizes:
        if value % world_size and not (field == "num_key_value_heads" and world_size % value == 0):
            return field, value
    return None


def shard_config(cfg: ModelArchConfig, world_size: int) -> ModelArchConfig:
    """One rank's config: its share of the query heads, KV heads, MLP width and each expert's width."""
    if cfg.architecture not in TP_ARCHITECTURES:
        raise UnsupportedModelError(f"tensor_parallel_size > 1 is not supported for {cfg.architecture}; "
                                    f"supported: {', '.join(TP_ARCHITECTURES)}")
    bad = indivisible_field(cfg, world_size)
    if bad is not None:
        raise UnsupportedModelError(f"tensor_parallel_size {world_size} does not divide {bad[0]} ({bad[1]})")
    sizes = {"num_heads": cfg.num_heads // world_size, "num_kv_heads": max(1, cfg.num_kv_heads // world_size),
             "intermediate_size": cfg.intermediate_size // world_size}
    if isinstance(cfg, MoEArchConfig):
        sizes.update(moe_intermediate_size=cfg.moe_intermediate_size // world_size,
                     shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world_size)
    return dataclasses.replace(cfg, **sizes)


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelArchConfig, rank: int,
                 world_size: int) -> torch.Tensor:
    """Rank `rank`'s part of the checkpoint tensor `name` (`cfg`: the whole model's config). A row-parallel
    bias stays on rank 0 only (zeros elsewhere), so the ranks' sum adds it once."""
    module, _, leaf = name.rpartition(".")
    last = module.rsplit(".", 1)[-1]
    if last in KV_PROJECTIONS:
        return _kv_rows(tensor, cfg, rank, world_size)
    if last in COLUMN_PARALLEL:
        return tensor.chunk(world_size, 0)[rank]
    if last == "qkv_proj":  # stored fused: each part split on its own
        q, k, v = tensor.split(qkv_sizes(cfg), 0)
        return torch.cat([q.chunk(world_size, 0)[rank], _kv_rows(k, cfg, rank, world_size),
                          _kv_rows(v, cfg, rank, world_size)])
    if last == "gate_up_proj":
        return torch.cat([part.chunk(world_size, 0)[rank] for part in tensor.split(gate_up_sizes(cfg), 0)])
    if last in VOCAB_PARALLEL:
        return _vocab_rows(tensor, cfg.vocab_size, rank, world_size)
    if last == "experts":  # every expert stacked in one tensor: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        if leaf == "gate_up_proj":
            return torch.cat([part.chunk(world_size, 1)[rank] for part in tensor.chunk(2, 1)], 1)
        return tensor.chunk(world_size, 2)[rank]
    if last in ROW_PARALLEL_CHECKPOINT:
        if leaf == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return tensor.chunk(world_size, 1)[rank]
    return tensor


def shard_lora_pair(module: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelArchConfig, rank: int,
                    world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of a LoRA pair (A [r, K], B [N, r]) on target `module` (`cfg`: the whole model's config),
    as vLLM splits it: a column-parallel module keeps A whole and B's rows of its output slice (split as its base
    weight is, replicated KV heads too); a row-parallel one A's columns of its input slice and B whole, its
    partial delta summed with its partial output."""
    # Cloned: a view would keep the whole tensor alive in the host copies.
    if module in ROW_PARALLEL:
        return shard_tensor(f"{module}.weight", a, cfg, rank, world_size).clone(), b
    if module not in COLUMN_PARALLEL:
        raise ValueError(f"LoRA target {module!r} has no tensor-parallel split")
    return a, shard_tensor(f"{module}.weight", b, cfg, rank, world_size).clone()


def _kv_rows(tensor: torch.Tensor, cfg: ModelArchConfig, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s K or V rows: its share of the KV heads, or (fewer heads than ranks) the one head its query
    heads read, replicated on world_size / num_kv_heads ranks."""
    if cfg.num_kv_heads >= world_size:
        return tensor.chunk(world_size, 0)[rank]
    return tensor.chunk(cfg.num_kv_heads, 0)[rank // (world_size // cfg.num_kv_heads)]


def _vocab_rows(tensor: torch.Tensor, vocab_size: int, rank: int, world_size: int) -> torch.Tensor:
    """Rows [rank * Vp, (rank + 1) * Vp) of an embedding or head table, zero-padded past the vocabulary."""
    size = vocab_shard_size(vocab_size, world_size)
    rows = tensor[rank * size : (rank + 1) * size]
    if rows.shape[0] == size:
        return rows
    return torch.cat([rows, rows.new_zeros(size - rows.shape[0], *tensor.shape[1:])])


def _split_vocab(model: nn.Module, cfg: ModelArchConfig, world_size: int) -> None:
    """Give (on the meta device) the model an embedding and lm_head of Vp rows each, tied again when they are."""
    size = vocab_shard_size(cfg.vocab_size, world_size)
    model.embed_tokens = nn.Embedding(size, cfg.hidden_size)
    model.lm_head = nn.Linear(cfg.hidden_size, size, bias=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def load_sharded_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int,
                       rank: int, world_size: int) -> nn.Module:
    """Rank `rank`'s model: the family's classes built from the sharded config, filled with its slices."""
    if str(path).endswith(".gguf"):
        raise UnsupportedModelError("tensor_parallel_size > 1 is not supported for GGUF files")
    path = Path(path)
    if scheme_from_config(json.loads((path / "config.json").read_text())) is not None:
        raise UnsupportedModelError("tensor_parallel_size > 1 is not supported for quantized checkpoints")
    full = ModelArchConfig.from_pretrained(path)
    cfg = shard_config(full, world_size)
    family = family_for(cfg.architecture)
    model = empty_model(family, cfg, max_position, dtype, device, lambda m: _split_vocab(m, cfg, world_size))
    filled = place_checkpoint(model, family, cfg, iter_checkpoint(path),
                              lambda name, tensor: shard_tensor(name, tensor, full, rank, world_size))
    check_complete(model, filled)
    model.init_rope(dtype, device)
    model.eval()
    return model
