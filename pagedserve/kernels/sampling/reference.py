"""The torch reference of the sampler's ops: the oracle, and what runs off the CPU."""

from __future__ import annotations

import torch


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.to_float32 with torch's cast."""
    return x.float()


def sample_from_logits(logits: torch.Tensor, inv_temps: torch.Tensor, min_ps: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.sampling.sample_from_logits through a cumulative sum and searchsorted."""
    row_max = logits.amax(dim=-1, keepdim=True)
    # The row maximum's prob is exactly 1, which is what min_p scales.
    probs = ((logits - row_max) * inv_temps[:, None].to(logits.dtype)).exp_()
    probs.masked_fill_(probs < min_ps[:, None].to(probs.dtype), 0.0)
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the first cdf entry above it always exists and is a token with
    # non-zero probability (the cdf only rises at such tokens).
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum((uniforms[:, None] * total).to(cdf.dtype), below_total)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return tokens, (row_max.squeeze(1) * inv_temps.to(logits.dtype) + total.squeeze(1).log())


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.logsumexp with torch's."""
    return torch.logsumexp(logits, dim=-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """kernels.sampling.argmax with torch's."""
    return logits.argmax(dim=-1)
