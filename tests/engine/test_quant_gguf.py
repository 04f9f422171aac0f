"""GGUF served natively: Q8_0 / Q4_0 / Q4_1 unpacked bit-exactly into the int8 / int4 layouts, the engine on a GGUF
against its dequantized fp32 twin, unsupported types and truncated files refused cleanly (the other block formats:
test_gguf_blocks.py and test_gguf_kquants.py)."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.gguf_file import GGUFError
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.quantized import QuantizedEmbedding, QuantizedLinear, weight_bytes
from pagedserve.kernels import quant_linear as ql
from tests.support import tiny_gguf
from tests.support.engines import cpu_engine

ROWS, COLS = 5, 96  # an odd row count, three blocks per row


def _write(path, name, raw, kind):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_file.tensors(path)[name]


def _known(seed):
    rng = np.random.default_rng(seed)
    d = rng.uniform(-0.05, 0.05, (ROWS, COLS // 32)).astype(np.float16)
    m = rng.uniform(-0.5, 0.5, (ROWS, COLS // 32)).astype(np.float16)
    return rng, d, m


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_unpack_to_exactly_the_integers_and_scales_written(tmp_path, kind):
    rng, d, m = _known(len(kind))
    q = rng.integers(-128, 128, (ROWS, COLS)) if kind == "Q8_0" else rng.integers(0, 16, (ROWS, COLS))
    raw = {"Q8_0": lambda: tiny_gguf.q8_0_bytes(q, d), "Q4_0": lambda: tiny_gguf.q4_bytes(q, d),
           "Q4_1": lambda: tiny_gguf.q4_bytes(q, d, m)}[kind]()
    tensor = _write(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, getattr(gguf.GGMLQuantizationType, kind))
    weight = gguf_file.unpack(tensor)
    assert (weight.bits, weight.group_size, weight.out_features, weight.in_features) == (
        8 if kind == "Q8_0" else 4, 32, ROWS, COLS)
    assert torch.equal(weight.int_values(), torch.from_numpy(q).to(torch.int32))
    assert torch.equal(weight.scales, torch.from_numpy(d))
    per_col = lambda a: np.repeat(a.astype(np.float32), 32, axis=1)  # noqa: E731
    qf = q.astype(np.float32)
    expected = {"Q8_0": qf * per_col(d), "Q4_0": (qf - 8) * per_col(d), "Q4_1": qf * per_col(d) + per_col(m)}[kind]
    assert np.array_equal(weight.dequantize().numpy(), expected)
    # The gguf package's own dequantizer, a second oracle.
    assert np.array_equal(weight.dequantize().numpy(), gguf.quants.dequantize(raw, tensor.tensor_type))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_tensors_load_as_they_are(tmp_path, dtype):
    values = np.random.default_rng(0).standard_normal((3, 40)).astype(dtype)
    tensor = _write(tmp_path / "f.gguf", "blk.0.attn_norm.weight", values, None)
    assert np.array_equal(gguf_file.unpack(tensor).numpy(), values)


def test_bf16_tensors_load_as_they_are(tmp_path):
    values = torch.randn(4, 32).to(torch.bfloat16)
    raw = values.view(torch.int16).numpy().view(np.uint8).reshape(4, 64)
    tensor = _write(tmp_path / "b.gguf", "w", raw, gguf.GGMLQuantizationType.BF16)
    assert torch.equal(gguf_file.unpack(tensor), values)


def test_an_unsupported_quantized_tensor_is_refused_naming_the_tensor_and_its_type(tmp_path):
    raw = _zero_blocks(2)
    tensor = _write(tmp_path / "k.gguf", "blk.1.ffn_down.weight", raw, _UNSUPPORTED)
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_down\.weight' has type IQ2_XXS.*supported: F32, F16, BF16, "
                                        r"Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
        gguf_file.unpack(tensor)


_UNSUPPORTED = gguf.GGMLQuantizationType.IQ2_XXS  # a grid-coded i-quant pagedserve does not unpack


def _zero_blocks(rows):
    """Bytes of an unsupported type for `rows` rows of 256 values."""
    _, type_size = gguf.GGML_QUANT_SIZES[_UNSUPPORTED]
    return np.zeros((rows, type_size), dtype=np.uint8)


def _quantizer(name, w):
    """Projections Q4_1 (min/max) or Q4_0 (symmetric) in turn, the embedding Q8_0: every supported type."""
    if "embed" in name:
        return ql.quantize_int8(w, 32)
    return ql.quantize_int4(w, 32, symmetric="down_proj" in name or "o_proj" in name)


@pytest.fixture(scope="module")
def tiny_gguf_model(tiny_tied_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return tiny_gguf.write_model_gguf(tiny_tied_path, out, _quantizer)


def test_a_gguf_model_loads_with_its_own_integers_and_the_q_k_rows_back_in_order(tiny_gguf_model):
    model = load_gguf_model(tiny_gguf_model, torch.float32, torch.device("cpu"), 1024)
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.weight.bits == 4
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head.weight is model.embed_tokens.weight
    from safetensors.torch import load_file

    ref = load_file(str(tiny_gguf_model.with_suffix(".ref") / "model.safetensors"))
    qkv = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight.dequantize(), qkv)
    assert torch.equal(layer.mlp.down_proj.weight.dequantize(), ref["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.embed_tokens.weight.dequantize(), ref["model.embed_tokens.weight"])


def test_the_engine_on_a_gguf_file_matches_its_dequantized_fp32_twin(tiny_gguf_model):
    engine = cpu_engine(tiny_gguf_model, num_blocks=128, block_size=4)
    twin = cpu_engine(tiny_gguf_model.with_suffix(".ref"), num_blocks=128, block_size=4)
    assert weight_bytes(engine.runner.model) < weight_bytes(twin.runner.model)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(4, 30))] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    worst = 0.0
    for prompt in prompts:
        got = engine.generate([prompt], params)[0].prompt_logprobs
        want = twin.generate([prompt], params)[0].prompt_logprobs
        worst = max(worst, *(abs(a[t] - b[t]) for a, b, t in zip(got[1:], want[1:], prompt[1:], strict=True)))
    assert worst < 0.1  # torch's CPU kernels round activations, scales and outputs to bf16
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(engine.generate(prompts, greedy), twin.generate(prompts, greedy), strict=True))
    assert same >= len(prompts) * 2 // 3


def test_the_gguf_tokenizer_and_config_come_from_its_metadata(tiny_gguf_model, tiny_tied_path):
    engine = cpu_engine(tiny_gguf_model, num_blocks=16)
    twin = cpu_engine(tiny_tied_path, num_blocks=16)
    text = "Hello world! The capital of France is Paris."
    assert engine.tokenizer(text)["input_ids"] == twin.tokenizer(text)["input_ids"]
    assert engine.eos_token_ids >= {twin.tokenizer.eos_token_id}
    assert engine.runner.arch.num_heads == twin.runner.arch.num_heads


def test_quantization_on_top_of_a_gguf_file_is_refused(tiny_gguf_model):
    with pytest.raises(ValueError, match="served with its own quantization"):
        cpu_engine(tiny_gguf_model, num_blocks=16, quantization="int8")


@pytest.mark.parametrize("fraction", [0.001, 0.3, 0.999])
def test_a_truncated_gguf_fails_cleanly(tiny_gguf_model, tmp_path, fraction):
    data = tiny_gguf_model.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(GGUFError, match="truncated"):
        cpu_engine(cut, num_blocks=16)


def test_a_model_with_an_unsupported_tensor_type_is_refused_at_load_naming_the_tensor(tiny_tied_path, tmp_path):
    unsupported = _zero_blocks(128)
    path = tiny_gguf.write_model_gguf(tiny_tied_path, tmp_path / "k.gguf", _quantizer,
                                      replace={"blk.1.ffn_up.weight": (unsupported, _UNSUPPORTED)})
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' has type IQ2_XXS"):
        load_gguf_model(path, torch.float32, torch.device("cpu"), 1024)


@pytest.mark.slow
def test_the_default_model_served_from_its_q4_1_gguf_answers_paris_in_under_half_the_bytes_of_bf16():
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.model.default_model import find_gguf

    engine = LLMEngine.from_pretrained(str(find_gguf()), device="cpu", kv_cache_memory_bytes=64 << 20)
    model = engine.runner.model
    weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear)
                  and m is not model.lm_head) + model.embed_tokens.weight.in_features * engine.runner.arch.vocab_size
    # Q4_1 projections (0.5 byte a weight + scales) and the Q8_0 token table (1 byte), as the file stores them.
    assert weight_bytes(model) < 0.45 * 2 * weights
    question = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                    add_generation_prompt=True, tokenize=False)
    completion, chat = engine.generate(["The capital of France is", question],
                                       SamplingParams(temperature=0.0, max_tokens=12))
    assert "Paris" in completion.outputs[0].text and "Paris" in chat.outputs[0].text
    assert chat.outputs[0].finish_reason == "stop"
