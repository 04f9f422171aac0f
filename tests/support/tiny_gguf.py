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


def gguf_name(hf_name: str) -> str:
    """model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    name = hf_name.removeprefix("model.")
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, layer, *rest = name.split(".")
    return f"blk.{layer}.{_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
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
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
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


def _write_twin(folder: Path, target: Path, tensors: dict[str, torch.Tensor]) -> None:
    import shutil

    shutil.copytree(folder, target)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
