"""Write GGUF files from integers and scales the tests choose, block by block as ggml lays them out."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pagedserve.kernels.quant_linear import QuantizedWeight

Q = gguf.GGMLQuantizationType
BLOCK = 32


def q8_0_bytes(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 rows: per block of 32, d (fp16) then 32 int8 values. q [rows, cols] int, d [rows, cols/32]."""
    rows, cols = q.shape
    blocks = q.reshape(rows, cols // BLOCK, BLOCK).astype(np.int8).view(np.uint8)
    scales = d.astype(np.float16).reshape(rows, -1, 1).view(np.uint8)
    return np.concatenate([scales, blocks], axis=-1).reshape(rows, -1)


def q4_bytes(q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """Q4_0 (m None) / Q4_1 rows: d [, m] (fp16), then 16 bytes holding value j low and value j + 16 high."""
    rows, cols = q.shape
    values = q.reshape(rows, cols // BLOCK, BLOCK).astype(np.uint8)
    packed = values[..., :16] | (values[..., 16:] << 4)
    head = [d.astype(np.float16).reshape(rows, -1, 1).view(np.uint8)]
    if m is not None:
        head.append(m.astype(np.float16).reshape(rows, -1, 1).view(np.uint8))
    return np.concatenate([*head, packed], axis=-1).reshape(rows, -1)


def encode(weight: QuantizedWeight) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A group-32 QuantizedWeight as the GGUF bytes it came from: Q8_0, Q4_0 (offsets -8 * scales) or Q4_1."""
    assert weight.group_size == BLOCK
    q = weight.int_values().numpy()
    d = weight.scales.to(torch.float16).numpy()
    if weight.bits == 8:
        return q8_0_bytes(q, d), Q.Q8_0
    offsets = weight.offsets.to(torch.float16).numpy()
    if np.array_equal(offsets.astype(np.float32), -8 * d.astype(np.float32)):
        return q4_bytes(q, d), Q.Q4_0
    return q4_bytes(q, d, offsets), Q.Q4_1


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter order of Q/K rows (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


# Beyond Llama's: Q/K head norms, Phi-3's fused projections, Gemma's four norms (llama.cpp's names).
_FAMILY_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                 "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
# The MoE families' router and shared expert (llama.cpp's names); the router and the shared expert's gate stay F32.
_MOE_NAMES = {"mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_FLOAT_ONLY = ("ffn_gate_inp.", "ffn_gate_inp_shexp.")
# config.json model_type -> GGUF general.architecture (llama.cpp's converter writes Mixtral as llama).
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    name = hf_name.removeprefix("model.")
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, layer, *rest = name.split(".")
    names = {**_NAMES, **_FAMILY_NAMES, **_MOE_NAMES, **(_GEMMA_NAMES if arch.startswith("gemma") else {})}
    return f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"


# Byte offsets of each block format's fp16 fields (d, dmin): random bytes there could be inf or NaN.
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int, rms: float | None = None) -> np.ndarray:
    """Random valid [rows, cols] bytes of GGUF type `kind`: random integers and sub-block scales, finite fp16 d
    (and dmin) of either sign, scaled so the values' root mean square is about `rms` when given."""
    rng = np.random.default_rng(seed)
    qtype = getattr(Q, kind)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = cols // values
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    halves = {at: rng.uniform(-4, 4, (rows, blocks, 1)) * 10.0 ** rng.integers(-6, 3, (rows, blocks, 1))
              for at in HALF_FIELDS[kind]}
    if rms is not None:  # every value is linear in (d, dmin): scale them together
        for at in halves:
            halves[at] = rng.uniform(-1, 1, (rows, blocks, 1))
        if kind in _AFFINE_MIDDLE:
            _center_affine(kind, raw, halves)
        for at, d in halves.items():
            raw[..., at:at + 2] = d.astype(np.float16).view(np.uint8)
        got = np.sqrt(np.mean(gguf.quants.dequantize(raw.reshape(rows, -1), qtype) ** 2))
        halves = {at: d * (rms / got) for at, d in halves.items()}
    for at, d in halves.items():
        raw[..., at:at + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# The affine K-quants: the middle of their integers (Q2_K 0..3, Q4_K 0..15, Q5_K 0..31).
_AFFINE_MIDDLE = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


def _center_affine(kind: str, raw: np.ndarray, halves: dict[int, np.ndarray]) -> None:
    """Each sub-block's min set to its scale and dmin to d times the integers' middle, so values lie about zero
    (random mins would give each sub-block a large mean of its own)."""
    if kind == "Q2_K":  # a byte per sub-block: the scale in the low nibble, the min in the high
        raw[..., :16] = (raw[..., :16] & 15) * 17
    else:  # Q4_K / Q5_K: scale bytes 4..7 and low nibbles of 12..15, min bytes 8..11 and high nibbles
        raw[..., 8:12] = raw[..., 4:8]
        raw[..., 12:16] = (raw[..., 12:16] & 15) * 17
    d_at, dmin_at = HALF_FIELDS[kind]
    halves[dmin_at] = halves[d_at] * _AFFINE_MIDDLE[kind]


def write_blocks_gguf(folder: Path, out: Path, kind_of, *, seed: int = 0, metadata: dict | None = None,
                      stack_experts: bool = True) -> Path:
    """The tiny HF model in `folder` as a GGUF of its architecture at `out` whose 2-D tensors are blocks of the type
    `kind_of(gguf_name)` gives (None: the float weight as it is), see _blocks_of; Gemma's norms stored as 1 + weight, Llama's Q/K rows permuted, as llama.cpp's converter does.
    Writes the twin checkpoint of the dequantized fp32 weights beside it (`out`.ref/); `metadata` overrides
    config keys in the file's metadata only (to make it contradict its tensors); `stack_experts` False writes an
    MoE's experts one tensor each (blk.N.ffn_gate.E.weight), as early Mixtral files have them."""
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    tensors = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, {**config, **(metadata or {})}, folder)
    twin = _write_experts(writer, tensors, kind_of, seed, stack_experts)
    for i, (name, tensor) in enumerate(sorted(tensors.items())):
        target = gguf_name(name, arch)
        float_only = any(f".{part}" in target for part in _FLOAT_ONLY)
        kind = kind_of(target) if tensor.dim() == 2 and not float_only else None
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}.get(
            name.split(".")[-2]) if arch == "llama" else None
        if kind is None:
            stored = tensor + 1 if arch.startswith("gemma") and "norm" in name else tensor
            twin[name] = stored - 1 if arch.startswith("gemma") and "norm" in name else stored
            if target.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp's converter writes it as a vector
                stored = stored.reshape(-1)
            writer.add_tensor(target, (permute_qk(stored, heads) if heads else stored).numpy())
            continue
        raw = _blocks_of(kind, tensor, seed * 1000 + i)
        twin[name] = torch.from_numpy(gguf.quants.dequantize(raw, getattr(Q, kind)))
        rows = permute_qk(torch.arange(tensor.shape[0]), heads).numpy() if heads else slice(None)
        writer.add_tensor(target, raw[rows], raw_dtype=getattr(Q, kind))
    _finish(writer)
    _write_twin(folder, out.with_suffix(".ref"), twin)
    return out


# Each expert's projection -> llama.cpp's stacked tensor (Mixtral's w1 / w3 / w2 are gate / up / down).
_EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                  "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def _write_experts(writer: gguf.GGUFWriter, tensors: dict[str, torch.Tensor], kind_of, seed: int,
                   stack: bool) -> dict:
    """Pop the per-expert tensors from `tensors` and write each layer's projection as one stacked [experts, rows,
    cols] tensor of type `kind_of(name)`, as llama.cpp's converter stacks them; returns their dequantized twins."""
    stacks: dict[tuple[str, str], dict[int, str]] = {}
    for name in [n for n in tensors if ".experts." in n]:
        head, expert, projection, _ = name.split(".experts.")[0], *name.split(".experts.")[1].split(".")
        stacks.setdefault((head, projection), {})[int(expert)] = name
    twin = {}
    for n, ((head, projection), names) in enumerate(sorted(stacks.items())):
        target = f"blk.{head.split('.')[2]}.{_EXPERT_STACKS[projection]}.weight"
        weights = [tensors.pop(names[e]) for e in range(len(names))]
        kind = kind_of(target)
        if kind is None:
            twin.update({names[e]: w for e, w in enumerate(weights)})
            writer.add_tensor(target, torch.stack(weights).numpy())
            continue
        raw = np.stack([_blocks_of(kind, w, seed * 1000 + 500 + n * 64 + e) for e, w in enumerate(weights)])
        twin.update({names[e]: torch.from_numpy(gguf.quants.dequantize(r, getattr(Q, kind))) for e, r in
                     enumerate(raw)})
        if stack:
            writer.add_tensor(target, raw, raw_dtype=getattr(Q, kind))
            continue
        for e, expert in enumerate(raw):
            writer.add_tensor(target.replace("_exps.", f".{e}."), expert, raw_dtype=getattr(Q, kind))
    return twin


def _blocks_of(kind: str, tensor: torch.Tensor, seed: int) -> np.ndarray:
    """The float weight quantized by gguf itself where it can (Q8_0, Q4_0/1, Q5_0/1), else random valid blocks of
    the weight's scale (gguf-py has no K-quant or IQ4 quantizer)."""
    try:
        return gguf.quants.quantize(tensor.float().numpy(), getattr(Q, kind))
    except NotImplementedError:
        return random_blocks(kind, *tensor.shape, seed=seed, rms=tensor.float().pow(2).mean().sqrt().item())


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model_gguf(folder: Path, out: Path, quantize, *, replace: dict | None = None) -> Path:
    """The tiny HF model in `folder` as a llama GGUF at `out`; `quantize(name, w)` gives a QuantizedWeight or None
    (kept float) per 2-D weight; `replace` maps a GGUF tensor name to (bytes, type) written instead. Writes the
    dequantized-fp32 twin checkpoint beside it (`out`.ref/)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_metadata(writer, config, folder)
    twin = {}
    for name, tensor in tensors.items():
        if gguf_name(name) in (replace or {}):
            data, kind = replace[gguf_name(name)]
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
            continue
        weight = _fp16_scales(quantize(name, tensor)) if tensor.dim() == 2 else None
        twin[name] = tensor if weight is None else weight.dequantize()
        data = twin[name] if weight is None else weight
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}.get(
            name.split(".")[-2])
        if weight is None:
            array = (permute_qk(data, heads) if heads else data).numpy()
            writer.add_tensor(gguf_name(name), array)
        else:
            rows = permute_qk(torch.arange(weight.out_features), heads) if heads else None
            raw, kind = encode(weight if rows is None else _rows(weight, rows))
            writer.add_tensor(gguf_name(name), raw, raw_dtype=kind)
    _finish(writer)
    _write_twin(folder, out.with_suffix(".ref"), twin)
    return out


def _fp16_scales(weight: QuantizedWeight | None) -> QuantizedWeight | None:
    """The weight with the fp16 scales and offsets a GGUF block stores."""
    if weight is None:
        return None
    offsets = None if weight.offsets is None else weight.offsets.to(torch.float16)
    return QuantizedWeight(weight.qweight, weight.scales.to(torch.float16), offsets, weight.bits, weight.group_size,
                           weight.in_features)


def _rows(weight: QuantizedWeight, rows: torch.Tensor) -> QuantizedWeight:
    from pagedserve.kernels.quant_linear.layout import select_rows

    return select_rows(weight, rows)


def _write_metadata(writer: gguf.GGUFWriter, config: dict, folder: Path) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers' base is the file's
    writer.add_rope_freq_base(config.get("rope_theta") or rope["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(config["vocab_size"])
    _write_family_metadata(writer, config)
    _write_moe_metadata(writer, config)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template", ""))


def _write_family_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """The keys llama.cpp's converter writes for a head_dim of its own and for windows and soft-caps."""
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(name):
            getattr(writer, f"add_{name}")(config[name])
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # the per-frequency factors llama.cpp's converter stores
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, config))
    if rope.get("rope_type") == "longrope":  # Phi-3's: factor tensors beside the weights
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                             or config["original_max_position_embeddings"])
        if rope.get("attention_factor"):
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _write_moe_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    """The expert keys llama.cpp's converter writes (Mixtral's experts are intermediate_size wide)."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def llama3_rope_factors(rope: dict, config: dict) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for a llama3 rope scaling (its own formula)."""
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_twin(folder: Path, target: Path, tensors: dict[str, torch.Tensor]) -> None:
    import shutil

    shutil.copytree(folder, target)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})


def write_dequantized_twin(path: Path, folder: Path) -> Path:
    """Replace the weights of the tiny HF model in `folder` (the one `path` was made from) by what gguf-py
    dequantizes from the GGUF file at `path`, each tensor put back as the converter took it: experts out of their
    stacks, Q/K rows unpermuted (llama), Gemma's norms less one; returns `folder`."""
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    weights = {}
    for name, original in load_file(str(folder / "model.safetensors")).items():
        if ".experts." in name:
            head, expert, projection, _ = name.split(".experts.")[0], *name.split(".experts.")[1].split(".")
            value = dequantized(stored[f"blk.{head.split('.')[2]}.{_EXPERT_STACKS[projection]}.weight"])[int(expert)]
        else:
            value = dequantized(stored[gguf_name(name, arch)])
        value = torch.from_numpy(value.copy()).reshape(original.shape)
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}.get(
            name.split(".")[-2]) if arch == "llama" else None
        if heads:  # the converter's row p[i] went to row i
            unpermuted = torch.empty_like(value)
            unpermuted[permute_qk(torch.arange(value.shape[0]), heads)] = value
            value = unpermuted
        weights[name] = value - 1 if arch.startswith("gemma") and "norm" in name else value
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def dequantized(tensor) -> np.ndarray:
    """gguf-py's own reading of a GGUF tensor, its dimensions outermost first."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(shape)
