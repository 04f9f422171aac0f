"""Qwen2.5-VL's vision transformer: images at their own resolution cut into 14-pixel patches (two frames deep,
a Conv3d), 2-D rotary positions (a patch's row and column), RMSNorm pre-norm blocks with a SwiGLU MLP whose
attention is windowed (each window a few merged patches square) except in the `fullatt_block_indexes` blocks,
and the patch merger: each 2x2 group of neighbouring patches normalised, concatenated and projected into the
language model's width. Several images run in one pass, each attending only within itself."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.backend.model.vision.encoder import VisionMLP, activation


class VisionRMSNorm(nn.Module):
    """RMSNorm in fp32, the weight applied after casting back."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class WindowAttention(nn.Module):
    """Bidirectional attention within each segment of `cu_seqlens` (a window or a whole image), q and k rotated
    by the patches' 2-D positions in fp32."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, d]
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=self.head_dim**-0.5)
                for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
        out = torch.cat(outs, dim=2).squeeze(0).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionSwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), biased."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)
        self.act = F.silu if act == "silu" else activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, qwen2 = int(cfg["hidden_size"]), cfg["qwen2_vl"]
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6) if qwen2 else VisionRMSNorm(hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6) if qwen2 else VisionRMSNorm(hidden)
        self.attn = WindowAttention(hidden, int(cfg["num_heads"]))
        mlp = VisionMLP if qwen2 else VisionSwiGLU
        self.mlp = mlp(hidden, int(cfg["intermediate_size"]), cfg.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """mlp(norm(x) grouped merge_size**2 patches at a time): GELU between two linears."""

    def __init__(self, out_hidden: int, hidden: int, merge_size: int, layer_norm: bool):
        super().__init__()
        self.width = hidden * merge_size**2
        self.ln_q = nn.LayerNorm(hidden, eps=1e-6) if layer_norm else VisionRMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """A Conv3d over each flattened (channels, frames, patch, patch) patch, without bias."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        channels = int(cfg.get("in_channels", cfg.get("in_chans", 3)))  # (the hub's configs say in_chans)
        self.shape = (channels, int(cfg.get("temporal_patch_size", 2)), int(cfg["patch_size"]), int(cfg["patch_size"]))
        self.hidden = int(cfg["hidden_size"])
        self.proj = nn.Conv3d(self.shape[0], self.hidden, kernel_size=self.shape[1:], stride=self.shape[1:],
                              bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [P, C*T*p*p] -> [P, H]
        pixels = pixels.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(pixels).view(-1, self.hidden)


class Qwen25VisionTransformer(nn.Module):
    """The tower and merger; `forward(pixels, grids)` gives the merged tokens of every image, in order."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        cfg = _normalised(cfg)
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.patch_size = int(cfg["patch_size"])
        self.windowed = not cfg["qwen2_vl"]
        self.window_size = int(cfg.get("window_size", 112))
        self.full_blocks = set(cfg.get("fullatt_block_indexes", ()) if self.windowed else range(int(cfg["depth"])))
        head_dim = int(cfg["hidden_size"]) // int(cfg["num_heads"])
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.rotary = head_dim // 2  # half the head for rows, half for columns
        self.theta = theta
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(int(cfg["depth"])))
        self.merger = PatchMerger(int(cfg["out_hidden_size"]), int(cfg["hidden_size"]), self.merge, cfg["qwen2_vl"])

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged tokens [sum(t*h*w) / merge**2, out_hidden] of images whose patches (grid t, h, w) are
        concatenated in `pixels`."""
        unit = self.merge**2
        order, windows = self._windows(grids) if self.windowed else (torch.arange(sum(map(math.prod, grids)) // unit),
                                                                     [])
        images = [0]
        for t, h, w in grids:
            images += [images[-1] + h * w] * t  # each frame attends within itself
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        # (Computed here, not a buffer: the model is built on the meta device and only its weights are loaded.)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.rotary, 2, dtype=torch.float) / self.rotary)
        freqs = (self._positions(grids)[..., None].float() * inv_freq).to(x.device)  # [n, 2, rotary / 2]
        freqs = freqs.flatten(1).view(n // unit, unit, -1)[order].reshape(n, -1)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for index, block in enumerate(self.blocks):
            x = block(x, images if index in self.full_blocks else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each patch's (row, column), patches listed merge-group by merge-group as the processor lays them."""
        m, parts = self.merge, []
        for t, h, w in grids:
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            pos = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
            parts.append(pos.repeat(t, 1))
        return torch.cat(parts)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """(merge groups in window order, window boundaries in patches): each frame's grid of merge groups cut
        into squares of window_size pixels, row by row of windows, the edge ones smaller."""
        side = self.window_size // self.merge // self.patch_size
        order: list[torch.Tensor] = []
        bounds, first = [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            groups = torch.arange(t * gh * gw).view(t, gh, gw)
            for frame in range(t):
                for top in range(0, gh, side):
                    for left in range(0, gw, side):
                        window = groups[frame, top : top + side, left : left + side].flatten()
                        order.append(window + first)
                        bounds.append(bounds[-1] + window.numel() * self.merge**2)
            first += t * gh * gw
        return torch.cat(order), bounds


def _normalised(cfg: dict[str, Any]) -> dict[str, Any]:
    """The vision config in Qwen2.5-VL's keys, `qwen2_vl` telling Qwen2-VL's tower apart: there embed_dim is the
    tower's width, hidden_size the merger's output and mlp_ratio the MLP's, with LayerNorms, a two-layer MLP
    (quick_gelu) and full attention in every block."""
    if "embed_dim" not in cfg:
        return {**cfg, "qwen2_vl": False}
    width = int(cfg["embed_dim"])
    return {**cfg, "qwen2_vl": True, "hidden_size": width, "out_hidden_size": int(cfg["hidden_size"]),
            "intermediate_size": int(width * float(cfg.get("mlp_ratio", 4))),
            "hidden_act": cfg.get("hidden_act", "quick_gelu")}
