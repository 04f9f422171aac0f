"""Read a GGUF file: its metadata as a config.json dict, and each tensor unpacked exactly into a QuantizedWeight
(the quantized types of gguf_blocks.FORMATS: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS) or a float
tensor (F32, F16, BF16); a stacked 3-D expert tensor into one such weight per expert. Other tensor types are refused
naming the tensor."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedserve.backend.model.gguf_blocks import FORMATS, unpack_blocks
from pagedserve.kernels.quant_linear import QuantizedWeight


class GGUFArch(NamedTuple):
    """How a GGUF general.architecture loads: the Hugging Face architecture, whether llama.cpp's converter
    permuted each head's Q/K rows (llama's does), and whether it stored Gemma's norms as 1 + weight."""

    hf: str
    permuted: bool = False
    gemma: bool = False


ARCHITECTURES = {
    "llama": GGUFArch("LlamaForCausalLM", permuted=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM"),
    "qwen3": GGUFArch("Qwen3ForCausalLM"),
    "phi3": GGUFArch("Phi3ForCausalLM"),
    "gemma2": GGUFArch("Gemma2ForCausalLM", gemma=True),
    "gemma3": GGUFArch("Gemma3ForCausalLM", gemma=True),
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM"),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM"),
}
# llama.cpp's converter writes Mixtral as `llama` with expert tensors (its expert_count set).
MIXTRAL = GGUFArch("MixtralForCausalLM", permuted=True)
# Whether an architecture's top-k expert weights are rescaled to sum to one when the file does not say
# (expert_weights_norm): as llama.cpp's graph for each (Qwen3-MoE and Mixtral do, Qwen2-MoE does not).
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# Tensors that carry config, not weights: Phi-3's LongRoPE factors (long, short), Llama 3's rope factors.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Gemma layers per model size whose attention llama.cpp scales by hidden / heads, not head_dim (the 27B models).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = tuple(FORMATS)


class GGUFError(ValueError):
    """A GGUF file pagedserve cannot serve: unreadable, truncated, or holding a type or architecture it lacks."""


def is_gguf(path: str | Path) -> bool:
    """True for a path to a .gguf file."""
    return str(path).endswith(".gguf") and Path(path).is_file()


def read(path: str | Path) -> Any:
    """The file's gguf.GGUFReader (memory-mapped, cached per file version); GGUFError when it does not parse or its
    tensor data runs past the end of the file."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as error:
        raise GGUFError(f"cannot read GGUF file {str(path)!r}: {error.strerror}") from None
    return _read(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int, size: int) -> Any:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, IndexError or numpy errors on a cut-off file
        raise GGUFError(f"GGUF file {path!r} is truncated or corrupt ({type(error).__name__}: {error})") from None
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise GGUFError(f"GGUF file {path!r} is truncated: tensor {tensor.name!r} ends at byte "
                            f"{tensor.data_offset + tensor.n_bytes}, the file has {size}")
    return reader


def field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value (a scalar, a string or a list), `default` when absent."""
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def config_dict(path: str | Path) -> dict[str, Any]:
    """The file's metadata as the config.json keys ModelArchConfig reads."""
    reader = read(path)
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        value = field(reader, f"{arch}.{key}", default)
        if required and value is None:
            raise GGUFError(f"GGUF file {str(path)!r} lacks the metadata key {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    heads = int(meta("attention.head_count", required=True))
    hidden = int(meta("embedding_length", required=True))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    if meta("rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    elif meta("rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"GGUF rope scaling {meta('rope.scaling.type')!r} is not supported; supported: linear")
    config = {
        "architectures": [_arch(reader, arch).hf],
        "vocab_size": int(meta("vocab_size", len(field(reader, "tokenizer.ggml.tokens", [])))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length", required=True)),
        "num_hidden_layers": int(meta("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
    }
    return {**config, **_family_keys(arch, reader, meta, config, names)}


def _longrope(reader: Any, meta: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE as config.json's rope_parameters: its factor tensors, original context and attention factor."""
    factors = {t.name: [float(v) for v in np.array(t.data, dtype=np.float32).ravel()] for t in reader.tensors
               if t.name in LONGROPE_TENSORS}
    if len(factors) != 2:
        raise GGUFError(f"GGUF phi3 LongRoPE needs both {' and '.join(LONGROPE_TENSORS)}; the file has {list(factors)}")
    params = {**rope, "rope_type": "longrope", "long_factor": factors[LONGROPE_TENSORS[0]],
              "short_factor": factors[LONGROPE_TENSORS[1]],
              "original_max_position_embeddings": int(meta("rope.scaling.original_context_length", required=True))}
    if meta("rope.scaling.attn_factor") is not None:
        params["attention_factor"] = float(meta("rope.scaling.attn_factor"))
    return params


def _llama3_rope(reader: Any, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Llama 3.x's rope scaling from the per-frequency factors llama.cpp's converter stores (rope_freqs.weight): the
    config keys (factor, low/high_freq_factor, original context) whose factors they are, found by trying the usual
    ones; a file whose factors none reproduces is refused."""
    stored = next(np.array(t.data, dtype=np.float64).ravel() for t in reader.tensors if t.name == ROPE_FREQS_TENSOR)
    if np.allclose(stored, 1.0):
        return rope
    factor = float(stored.max())
    wavelen = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    # Llama 3's own (1, 4) first: scaling all three by one number gives the same factors.
    for low, high, original in itertools.product((1.0, 0.5, 2.0), (4.0, 2.0, 8.0), [2**k for k in range(4, 21)]):
        if high <= low:
            continue
        smooth = (original / wavelen - low) / (high - low)
        want = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor,
                                                                 1 / ((1 - smooth) / factor + smooth)))
        if stored.shape == want.shape and np.allclose(stored, want, rtol=1e-5, atol=0):
            return {**rope, "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise GGUFError(f"GGUF tensor {ROPE_FREQS_TENSOR!r} holds rope factors that no llama3 rope scaling reproduces")


def _family_keys(arch: str, reader: Any, meta: Any, config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The config.json keys a family adds, from its metadata (as llama.cpp reads them)."""
    keys: dict[str, Any] = _moe_keys(arch, meta, config) if meta("expert_count") or arch.endswith("moe") else {}
    if ROPE_FREQS_TENSOR in names:
        keys["rope_parameters"] = _llama3_rope(reader, config["rope_parameters"], config["head_dim"])
    if arch == "phi3":
        rotary = int(meta("rope.dimension_count", config["head_dim"]))
        keys.update(partial_rotary_factor=rotary / config["head_dim"], sliding_window=meta("attention.sliding_window"))
        if "rope_factors_long.weight" in names:
            keys["rope_parameters"] = _longrope(reader, meta, config["rope_parameters"])
    if arch in ("gemma2", "gemma3"):
        big = int(config["num_hidden_layers"]) == _GEMMA_27B_LAYERS[arch]
        keys.update(hidden_activation="gelu_pytorch_tanh", sliding_window=int(meta("attention.sliding_window", 4096)),
                    query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if big
                    else config["head_dim"])
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):  # absent: the family's defaults
            if meta(name) is not None:
                keys[name] = float(meta(name))
    if arch == "gemma3":
        keys.update(rope_local_base_freq=10000.0, rope_parameters={**config["rope_parameters"], "rope_theta": float(
            meta("rope.freq_base", 1_000_000.0))})
        if meta("attention.sliding_window_pattern") is not None:
            keys["sliding_window_pattern"] = int(meta("attention.sliding_window_pattern"))
    return keys


def _moe_keys(arch: str, meta: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The expert keys (Qwen-MoE's and Mixtral's config.json names) from llama.cpp's expert metadata."""
    experts = int(meta("expert_count", required=True))
    expert_ff = int(meta("expert_feed_forward_length", config["intermediate_size"]))
    norm = meta("expert_weights_norm")
    keys = {"num_experts": experts, "num_local_experts": experts,
            "num_experts_per_tok": int(meta("expert_used_count", required=True)), "moe_intermediate_size": expert_ff,
            "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length", 0)),
            "norm_topk_prob": _NORM_TOPK.get(arch, False) if norm is None else bool(norm),
            "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "llama":  # Mixtral's experts are intermediate_size wide
        keys["intermediate_size"] = expert_ff
    return keys


def _arch(reader: Any, arch: str) -> GGUFArch:
    """A `llama` file with experts is Mixtral's."""
    return MIXTRAL if arch == "llama" and field(reader, "llama.expert_count") else ARCHITECTURES[arch]


def architecture(path: str | Path) -> GGUFArch:
    """How the file's architecture loads (config_dict has refused the unsupported ones)."""
    reader = read(path)
    return _arch(reader, field(reader, "general.architecture"))


def permutes_qk(path: str | Path) -> bool:
    """True when the file's Q/K rows are in llama.cpp's rotary order (undone at load)."""
    return architecture(path).permuted


def tensors(path: str | Path) -> dict[str, Any]:
    """The file's tensors (gguf ReaderTensor) by name."""
    return {t.name: t for t in read(path).tensors}


def unpack(tensor: Any) -> QuantizedWeight | torch.Tensor:
    """A tensor exactly as stored: a quantized type as a QuantizedWeight (gguf_blocks.py), floats as float."""
    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        data = np.array(tensor.data)  # a copy: the memory map is read-only
        if kind == "BF16":
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(_shape(tensor))
        return torch.from_numpy(data).reshape(_shape(tensor))
    if kind not in QUANT_TYPES:
        raise GGUFError(f"GGUF tensor {tensor.name!r} has type {kind}, which pagedserve does not load; supported: "
                        f"{', '.join(FLOAT_TYPES + QUANT_TYPES)} (re-quantize the file to one of them)")
    shape = _shape(tensor)
    if len(shape) != 2:
        raise GGUFError(f"GGUF tensor {tensor.name!r} of type {kind} has shape {shape}; quantized tensors must be 2-D")
    try:
        return unpack_blocks(kind, torch.from_numpy(np.array(tensor.data)), *shape)
    except ValueError as error:
        raise GGUFError(f"GGUF tensor {tensor.name!r}: {error}") from None


def unpack_experts(tensor: Any) -> list[QuantizedWeight | torch.Tensor]:
    """A stacked [experts, rows, cols] tensor (ffn_*_exps) as one weight per expert, each exactly as stored."""
    shape = _shape(tensor)
    if len(shape) != 3:
        raise GGUFError(f"GGUF expert tensor {tensor.name!r} has shape {shape}; expert tensors are [experts, rows, "
                        "cols]")
    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        return list(unpack(tensor).unbind(0))
    if kind not in QUANT_TYPES:
        unpack(tensor)  # refused naming the tensor and its type
    data = torch.from_numpy(np.array(tensor.data)).reshape(shape[0], -1)
    try:
        return [unpack_blocks(kind, expert, *shape[1:]) for expert in data]
    except ValueError as error:
        raise GGUFError(f"GGUF tensor {tensor.name!r}: {error}") from None


def _shape(tensor: Any) -> tuple[int, ...]:
    """Rows first (GGUF lists the dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))
