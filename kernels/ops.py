"""The one kernel dispatcher: Triton kernels on CUDA tensors, the torch reference elsewhere.

`PAGEDSERVE_KERNELS=triton|torch|auto` (default auto) forces a side; Triton on CPU tensors works only
under `TRITON_INTERPRET=1`. The Triton modules are imported on first use, so CPU hosts need no triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch
from pagedserve.kernels import reference
from pagedserve.kernels.rope_cache import compute_cos_sin_cache

__all__ = [
    "compute_cos_sin_cache",
    "copy_blocks",
    "kernel_backend",
    "logsumexp",
    "to_float32",
    "sample_from_logits",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
]

_MODES = ("auto", "triton", "torch")
_triton_available: bool | None = None


def _has_triton() -> bool:
    global _triton_available
    if _triton_available is None:
        _triton_available = importlib.util.find_spec("triton") is not None
    return _triton_available


def _mode() -> str:
    raw = os.environ.get("PAGEDSERVE_KERNELS")
    if raw is None:  # the common case: a dozen dispatches per layer, so no string work
        return "auto"
    mode = raw.strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"PAGEDSERVE_KERNELS must be one of {', '.join(_MODES)}; got {mode!r}")
    return mode


_modules: dict[str, ModuleType] = {}


def _module(name: str) -> ModuleType:
    """A kernels submodule, imported on first use and then looked up in a dict."""
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(f".{name}", __package__)
    return module


def kernel_backend(tensor: torch.Tensor) -> str:
    """Which implementation serves this tensor: 'triton' or 'torch'."""
    mode = _mode()
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not _has_triton():
            raise RuntimeError("PAGEDSERVE_KERNELS=triton but the triton package is not installed")
        return "triton"
    return "triton" if tensor.is_cuda and _has_triton() else "torch"


def _impl(name: str, tensor: torch.Tensor) -> ModuleType:
    """The module holding `name` for this tensor's backend."""
    if kernel_backend(tensor) == "torch":
        return reference
    return _module(name)


def _cpu_impl(name: str, cpu_name: str, tensor: torch.Tensor) -> ModuleType:
    """Like _impl, but CPU tensors in auto mode take the engine's CPU module (native kernels, falling
    back to the reference by themselves); PAGEDSERVE_KERNELS=torch keeps the pure reference."""
    module = _impl(name, tensor)
    if module is reference and _mode() == "auto" and tensor.device.type == "cpu":
        return _module(cpu_name)
    return module


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 skipped
) -> None:
    """Write new K/V into their cache slots."""
    _impl("cache_triton", key).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:
    """Causal attention over the paged cache; query i of sequence s sits at seq_lens[s] - q_len_s + i.

    CPU tensors in auto mode take `attention_cpu` (native decode kernel, unpadded prefill), which falls
    back to the reference by itself; PAGEDSERVE_KERNELS=torch keeps the pure reference.
    """
    return _cpu_impl("attention_triton", "attention_cpu", query).paged_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
        max_seqlen_q, max_seqlen_k, out,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding; returns new (query, key) tensors."""
    module = _cpu_impl("elementwise_triton", "elementwise_cpu", query)
    return module.rotary_embedding(positions, query, key, cos_sin_cache)


def rotary_embedding_and_cache(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 skipped
) -> torch.Tensor:
    """rotary_embedding, then reshape_and_cache of the rotated key and the value; returns the rotated query.

    One native pass on the CPU (the rotated key goes straight into its slot); elsewhere the two ops.
    """
    module = _cpu_impl("elementwise_triton", "elementwise_cpu", query)
    if module is _modules.get("elementwise_cpu"):
        fused = module.rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, key_cache,
                                                  value_cache, slot_mapping)
        if fused is not None:
            return fused
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return query


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with residual returns (norm(x + residual), x + residual)."""
    return _cpu_impl("elementwise_triton", "elementwise_cpu", x).rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SiLU(gate) * up over the two halves of the last dimension."""
    return _cpu_impl("elementwise_triton", "elementwise_cpu", x).silu_and_mul(x)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: list[tuple[int, int]],
) -> None:
    """Copy whole blocks (src, dst) in every layer's caches, for copy-on-write."""
    if not block_mapping:
        return
    _impl("cache_triton", key_caches[0]).copy_blocks(key_caches, value_caches, block_mapping)


def _native_rows(logits: torch.Tensor) -> bool:
    """CPU fp32 rows in auto mode with the native library: the sampler's ops run natively."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or _mode() != "auto":
        return False
    return _module("cpu_native").load() is not None


def sample_from_logits(
    logits: torch.Tensor,  # [R, V] fp32, -inf where masked
    inv_temps: torch.Tensor,  # [R]
    min_ps: torch.Tensor,  # [R]
    uniforms: torch.Tensor,  # [R] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One inverse-CDF draw per row at its temperature and min_p; returns (tokens, log normaliser)."""
    if _native_rows(logits):
        return _module("cpu_native").sample_from_logits(logits, inv_temps, min_ps, uniforms)
    return reference.sample_from_logits(logits, inv_temps, min_ps, uniforms)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R]
    """Log-sum-exp of each row."""
    if _native_rows(logits):
        return _module("cpu_native").logsumexp(logits)
    return reference.logsumexp(logits)


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 (the logits the sampler reads); bf16 CPU tensors widen natively."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and _mode() == "auto":
        native = _module("cpu_native")
        if native.load() is not None:
            return native.bf16_to_float(x)
    return x.float()
