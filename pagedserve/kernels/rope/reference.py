"""The torch reference of the neox rotary embedding, as transformers' Llama applies it."""

from __future__ import annotations

import torch


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.rope.rotary_embedding with torch ops, the table cast to the activation dtype first."""
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(query), rotate(key)
