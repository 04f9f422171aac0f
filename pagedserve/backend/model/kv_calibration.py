"""Computed K/V cache scales for an 8-bit KV cache (`calculate_kv_scales`, vLLM's name and rule).

vLLM sets each attention layer's scales from the first forward it runs: k_scale = max|K| / 200 and
v_scale = max|V| / 100 (its K_SCALE_CONSTANT, V_SCALE_CONSTANT), then frozen. Here they come from one forward over
a fixed calibration text at start, before any request, so the scales (and so the outputs) do not depend on which
request happened to come first, and every tensor-parallel rank runs that forward together (its own heads' scales).
The forward writes into temporary caches in the model's dtype, so the maxima are over the exact K (rotated) and V
the real cache would be handed. Scales a checkpoint gives are kept (kv_scales.py); only the others are computed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.config import ModelArchConfig
from pagedserve.backend.model.kv_scales import CHECKPOINT_SCALES
from pagedserve.backend.model.llama import Attention

# The calibration's largest |K| lands at 200 of e4m3's 448 (|V| at 100): headroom for later, larger values.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
CALIBRATION_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built wooden machines that riders pushed along with their feet. By 1890 the safety bicycle, with two wheels "
    "of equal size, a chain drive and air-filled tyres, had made cycling popular across Europe and America.\n\n"
    "Q: What is 17 times 23? Explain each step.\nA: 17 x 20 = 340 and 17 x 3 = 51, so 17 x 23 = 391.\n\n"
    "def mean(values: list[float]) -> float:\n    \"\"\"The arithmetic mean; raises on an empty list.\"\"\"\n"
    "    if not values:\n        raise ValueError('no values')\n    return sum(values) / len(values)\n\n"
    "User: Could you write a short poem about the sea at night?\nAssistant: The moon lays silver on the tide, "
    "the harbour lights grow dim; the waves keep time on the sleeping stones, a slow and endless hymn.\n"
    "Les vagues, die Wellen, las olas: 海の波. Prices rose 3.5% in March (from $1,204 to $1,246)."
)


def scaled_layers(model: nn.Module) -> list[Attention]:
    """The decoder attention layers whose K or V scale the checkpoint did not give."""
    return [module for module in model.modules() if isinstance(module, Attention)
            and len(getattr(module, CHECKPOINT_SCALES, ())) < 2]


def calibration_ids(tokenizer, max_tokens: int) -> list[int]:
    """The calibration text's token ids as a prompt of it would have them (the tokenizer's special tokens too), at
    most max_tokens: the rotary table spans only max_model_len positions."""
    return tokenizer.encode(CALIBRATION_TEXT)[:max_tokens]


@torch.inference_mode()
def calculate_kv_scales(model: nn.Module, arch: ModelArchConfig, token_ids: list[int], dtype: torch.dtype,
                        device: torch.device, block_size: int) -> dict[int, tuple[float, float]]:
    """Set k_scale / v_scale on every layer the checkpoint gave none, from one forward over `token_ids`, once;
    returns {layer index: (k_scale, v_scale)} as now set. `arch`: this rank's heads under tensor parallelism."""
    layers = scaled_layers(model)
    if not layers:
        return {}
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(arch.num_layers)]
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions,
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        max_seqlen_q=num_tokens,
        max_seqlen_k=num_tokens,
    )
    model(torch.tensor(token_ids, dtype=torch.int64, device=device), positions, caches, meta)
    scales = {}
    for layer in layers:
        key, value = (cache.flatten(0, 1)[:num_tokens] for cache in caches[layer.layer_idx])
        given = getattr(layer, CHECKPOINT_SCALES, ())
        for name, written, constant in (("k_scale", key, K_SCALE_CONSTANT), ("v_scale", value, V_SCALE_CONSTANT)):
            amax = float(written.abs().max().float())
            if name not in given and math.isfinite(amax) and amax > 0:  # an all-zero K or V keeps 1.0
                setattr(layer, name, amax / constant)
        scales[layer.layer_idx] = (layer.k_scale, layer.v_scale)
    return scales
