"""The engine's kernels, one folder per op: its public entry, torch reference, Triton and CPU kernels.

Each entry picks its implementation per call (`dispatch.backend_for`); the engine imports them from here.
"""

from pagedserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels.cache import copy_blocks, reshape_and_cache
from pagedserve.kernels.lora import lora_expand_add, lora_shrink, lora_shrink_expand_add
from pagedserve.kernels.moe import fused_moe, topk_routing
from pagedserve.kernels.norm import rms_norm
from pagedserve.kernels.rejection import rejection_sample
from pagedserve.kernels.rope import compute_cos_sin_cache, rotary_embedding, rotary_embedding_and_cache
from pagedserve.kernels.sampling import argmax, logsumexp, sample_from_logits, to_float32

__all__ = [
    "argmax",
    "compute_cos_sin_cache",
    "copy_blocks",
    "fused_moe",
    "gelu_tanh_and_mul",
    "logsumexp",
    "lora_expand_add",
    "lora_shrink",
    "lora_shrink_expand_add",
    "paged_attention",
    "rejection_sample",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "sample_from_logits",
    "silu_and_mul",
    "to_float32",
    "topk_routing",
]
