"""A model family as the loader sees it: its config class, its model class, and where each checkpoint tensor
goes in the model's (possibly fused or stacked) parameters."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from pagedserve.backend.model.config import ModelArchConfig

# Indexes applied as `param.data[selector]`: a row slice of a fused parameter, or (expert, rows) of a stacked one.
Selector = tuple[int | slice, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one checkpoint tensor lands: our parameter's name and the part of it (None: all of it)."""

    param: str
    selector: Selector | None = None


@dataclass(frozen=True, slots=True)
class Fused:
    """One of our modules whose weight stacks several checkpoint modules along its rows."""

    parts: tuple[str, ...]  # the checkpoint modules' last names, in row order
    sizes: Callable[[ModelArchConfig], list[int]]  # their row counts


def qkv_sizes(cfg: ModelArchConfig) -> list[int]:
    """Rows of q, k and v in a fused qkv_proj."""
    kv = cfg.num_kv_heads * cfg.head_dim
    return [cfg.num_heads * cfg.head_dim, kv, kv]


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first of `renames`' (old prefix, new prefix) pairs it starts with replaced; as it is if none."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def gate_up_sizes(cfg: ModelArchConfig) -> list[int]:
    """Rows of gate and up in a fused gate_up_proj."""
    return [cfg.intermediate_size, cfg.intermediate_size]


# Llama's checkpoints store q/k/v and gate/up apart; our modules fuse them.
SPLIT_QKV_GATE_UP = {
    "qkv_proj": Fused(("q_proj", "k_proj", "v_proj"), qkv_sizes),
    "gate_up_proj": Fused(("gate_proj", "up_proj"), gate_up_sizes),
}


@dataclass(frozen=True)
class ModelFamily:
    """How an architecture plugs in. A family with other checkpoint names (stacked experts, say) subclasses this
    and overrides `placement` (and `module_target` if its quantized projections differ), falling back to super.

    `config_cls.from_dict` reads the family's own config.json keys; `model_cls(cfg, max_position)` builds the
    model on the meta device; `fused` names our modules that stack several checkpoint modules (a checkpoint that
    stores them already fused, as Phi-3's qkv_proj, needs no entry: its names are ours).
    """

    config_cls: type[ModelArchConfig]
    model_cls: type[nn.Module]
    fused: dict[str, Fused] = field(default_factory=lambda: dict(SPLIT_QKV_GATE_UP))
    ignored: re.Pattern = re.compile(r"rotary_emb\.inv_freq$")

    def placement(self, name: str, cfg: ModelArchConfig) -> Placement | None:
        """Where the checkpoint tensor `name` goes; None for a tensor the model does not use."""
        if self.ignored.search(name):
            return None
        name = name.removeprefix("model.")
        module, _, leaf = name.rpartition(".")
        target, index, _ = self.module_target(module)
        if index is None:
            return Placement(name)
        sizes = self.fused[target.rsplit(".", 1)[-1]].sizes(cfg)
        start = sum(sizes[:index])
        return Placement(f"{target}.{leaf}", (slice(start, start + sizes[index]),))

    def module_target(self, module: str) -> tuple[str, int | None, int]:
        """(our module, piece index or None when not fused, number of pieces) for a checkpoint module name."""
        module = module.removeprefix("model.")
        parent, _, last = module.rpartition(".")
        for fused_name, fused in self.fused.items():
            if last in fused.parts and "." in parent:
                return f"{parent}.{fused_name}", fused.parts.index(last), len(fused.parts)
        return module, None, 1
