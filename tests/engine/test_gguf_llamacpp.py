"""GGUF files written by llama.cpp's own `llama-quantize` (tests/fixtures/llamacpp/, made by
tests/support/make_llamacpp_fixtures.py from a tiny random Llama): every tensor unpacks to exactly what gguf-py's
dequantize gives, and the file served as stored gives transformers' greedy tokens and prompt logprobs on those
dequantized weights."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model import gguf_file
from pagedserve.backend.model.gguf_loader import load_gguf_model
from pagedserve.backend.model.quantized import QuantizedEmbedding, QuantizedLinear
from pagedserve.kernels.quant_linear import QuantizedWeight
from tests.support import tiny_gguf
from tests.support.engines import cpu_engine, greedy
from tests.support.make_llamacpp_fixtures import MODEL, TYPES, fixture, make_hf_model

# The types llama-quantize chose within each mix (the tied token table as the output, Q6_K).
MIXES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q6_K": {"Q6_K"}, "Q5_K_S": {"Q5_K", "Q6_K"},
         "Q3_K_M": {"Q3_K", "Q4_K", "Q5_K", "Q6_K"}, "IQ4_XS": {"IQ4_XS", "Q6_K"}}


def _dequantized(tensor) -> np.ndarray:
    """gguf-py's own reading of a tensor, rows first."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(shape)


def test_the_fixtures_are_small():
    assert sum(fixture(kind).stat().st_size for kind in TYPES) < 2 * 2**20


@pytest.mark.parametrize("kind", TYPES)
def test_every_tensor_of_a_llama_quantize_file_unpacks_as_gguf_dequantizes_it(kind):
    found = set()
    for tensor in gguf_file.read(fixture(kind)).tensors:
        got = gguf_file.unpack(tensor)
        if isinstance(got, QuantizedWeight):
            got = got.dequantize()
            found.add(tensor.tensor_type.name)
        assert torch.equal(got, torch.from_numpy(_dequantized(tensor))), tensor.name
    assert found == MIXES[kind]


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict:
    """Per fixture, the tiny model's folder holding the weights gguf-py dequantizes from it (Q/K rows back in
    Hugging Face order)."""
    made = {}
    for kind in TYPES:
        folder = make_hf_model(tmp_path_factory.mktemp(kind) / "hf")
        tensors = gguf_file.tensors(fixture(kind))
        weights = {}
        for name in load_file(str(folder / "model.safetensors")):
            stored = torch.from_numpy(_dequantized(tensors[tiny_gguf.gguf_name(name)]).copy())
            heads = {"q_proj": 4, "k_proj": 2}.get(name.split(".")[-2])
            if heads:  # the converter's row p[i] went to row i
                weights[name] = torch.empty_like(stored)
                weights[name][tiny_gguf.permute_qk(torch.arange(stored.shape[0]), heads)] = stored
            else:
                weights[name] = stored
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        made[kind] = folder
    return made


@pytest.mark.parametrize("kind", TYPES)
def test_a_llama_quantize_file_serves_transformers_tokens_on_its_dequantized_weights(kind, twins, hf_reference):
    assert MODEL["num_heads"] == 4 and MODEL["num_kv_heads"] == 2  # the twins' Q/K heads
    model = load_gguf_model(fixture(kind), torch.float32, torch.device("cpu"), 1024)
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.lm_head.weight is model.embed_tokens.weight
    engine = cpu_engine(fixture(kind), num_blocks=64, block_size=4)
    rng = random.Random(37)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(5, 24))] for _ in range(6)]
    outputs = [out.outputs[0].token_ids for out in engine.generate(prompts, greedy(10))]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_reference.greedy(twins[kind], prompt, 10)[0], prompt
    scored = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, out in zip(prompts, scored, strict=True):
        got = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        assert got == pytest.approx(hf_reference.prompt_logprobs(twins[kind], prompt), rel=2e-5, abs=1e-4)
