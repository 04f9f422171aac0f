"""The rotary cos/sin cache, with llama3, linear and longrope scaling, computed in fp32 as transformers does."""

from __future__ import annotations

import math

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth blend in between."""
    for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if name not in scaling:
            raise ValueError(f"rope_scaling.{name} is required for rope_type 'llama3'")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope(head_dim: int, rope_theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-pair factors dividing the frequencies, the long set when the table reaches past the
    original context (the whole context uses one set, so a position's rotation never depends on the batch), and
    cos/sin scaled by the attention factor."""
    for name in ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"):
        if name not in scaling:
            raise ValueError(f"rope_scaling.{name} is required for rope_type 'longrope'")
    use_long = max_position > int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor" if use_long else "short_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(f"rope_scaling.{'long' if use_long else 'short'}_factor has {len(factors)} values; the "
                         f"rotary dimension {head_dim} needs {head_dim // 2}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope_theta**exponents)
    return inv_freq, float(scaling["attention_factor"])


def _inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None,
              max_position: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [D/2] in fp32, scaled as the config says, and the factor on cos/sin."""
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "longrope":
        return _longrope(head_dim, rope_theta, rope_scaling, max_position)
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    if rope_type == "linear":
        if "factor" not in rope_scaling:
            raise ValueError("rope_scaling.factor is required for rope_type 'linear'")
        return inv_freq / float(rope_scaling["factor"]), 1.0
    raise ValueError(f"rope_scaling.rope_type must be one of default, llama3, linear, longrope; got {rope_type!r}")


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    rope_theta: float,
    rope_scaling: dict | None,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # -> [max_position, head_dim], rows [cos(D/2) | sin(D/2)]
    """Cos/sin table for positions 0..max_position-1, cast to dtype after the fp32 computation. `head_dim` is
    the rotary dimension (less than the head's under partial rotary)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    inv_freq, scale = _inv_freq(head_dim, float(rope_theta), rope_scaling, max_position)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1).to(dtype=dtype, device=device)
