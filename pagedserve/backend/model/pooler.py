"""How a pooling model turns a sequence's hidden states into one vector, as its folder says: sentence-transformers'
module files (`modules.json`, `1_Pooling/config.json`: CLS, mean, last token; `Normalize`), or the model's own
default (an encoder's CLS, a decoder's last token); and the pooling itself over a step's flat rows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.backend.model.config import UnsupportedModelError

POOLING_TYPES = ("cls", "mean", "lasttoken")
# sentence-transformers' Pooling config keys -> ours; any other mode set true is refused.
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "lasttoken"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    """A folder's pooling: the type, whether the vector is L2-normalised, the longest input sentence-transformers
    takes (None: the model's), and its named prompts (`config_sentence_transformers.json`) with the one it
    puts before an input that names none."""

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    from_sentence_transformers: bool = False
    default_prompt_name: str | None = None


def read_pooling_config(path: str | Path, default_pooling: str, default_normalize: bool) -> PoolingConfig:
    """The folder's sentence-transformers pooling, or the model's default where it has no modules.json."""
    path = Path(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(default_pooling, default_normalize)
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise UnsupportedModelError(f"sentence-transformers modules {unknown} are not supported; supported: "
                                    "Transformer, Pooling, Normalize")
    pooling_type = default_pooling
    if "Pooling" in kinds:
        pooling_dir = path / modules[kinds.index("Pooling")].get("path", "1_Pooling")
        pooling_type = _pooling_type(json.loads((pooling_dir / "config.json").read_text()))
    st_config = _read_json(path / "sentence_bert_config.json")
    max_len = st_config.get("max_seq_length")
    st_settings = _read_json(path / "config_sentence_transformers.json")
    prompts = st_settings.get("prompts") or {}
    return PoolingConfig(pooling_type, "Normalize" in kinds, int(max_len) if max_len else None,
                         {str(k): str(v) for k, v in prompts.items()}, True, st_settings.get("default_prompt_name"))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _pooling_type(config: dict) -> str:
    """The one pooling mode a Pooling config turns on."""
    if "pooling_mode" in config:  # newer sentence-transformers write the mode by name
        mode = {"cls_token": "cls", "mean_tokens": "mean"}.get(config["pooling_mode"], config["pooling_mode"])
        if mode not in POOLING_TYPES:
            raise UnsupportedModelError(f"pooling mode {config['pooling_mode']!r} is not supported; supported: "
                                        f"{', '.join(POOLING_TYPES)}")
        return mode
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    bad = [key for key in on if key in _UNSUPPORTED_MODES or key not in _MODES]
    if bad or len(on) != 1:
        raise UnsupportedModelError(f"1_Pooling/config.json must turn on exactly one of {', '.join(_MODES)}; "
                                    f"it turns on {on or 'none'}")
    return _MODES[on[0]]


def pool_rows(hidden: torch.Tensor, starts: list[int], lengths: list[int], pooling_type: str) -> torch.Tensor:
    """One vector per sequence from the flat hidden rows [T, H]: sequence i is rows starts[i] : starts[i] +
    lengths[i], all its tokens; returns [N, H] in fp32 (mean pooling sums in fp32)."""
    if pooling_type == "cls":
        return hidden[starts].float()
    if pooling_type == "lasttoken":
        return hidden[[s + n - 1 for s, n in zip(starts, lengths, strict=True)]].float()
    return torch.stack([hidden[s : s + n].float().mean(0) for s, n in zip(starts, lengths, strict=True)])
