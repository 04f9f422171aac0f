"""Prepacked oneDNN linear layers: what the CPU model runs instead of F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.backend.model import cpu_linear
from pagedserve.backend.model.cpu_linear import PackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(not can_prepack(), reason="this torch build has no oneDNN packed linear")


@pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="oneDNN's bf16 linear needs avx512 or avx_ne_convert")
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_is_bit_identical_in_bf16(rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear, 64)(x), linear(x))


def test_packed_linear_matches_fp32_to_rounding():
    torch.manual_seed(1)
    linear = nn.Linear(576, 300, bias=False)
    x = torch.randn(33, 576)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear, 64)(x), linear(x), atol=1e-4, rtol=1e-5)


def test_prepack_replaces_every_linear_and_keeps_a_tied_embedding_table():
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.block = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False))
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight
    ids = torch.tensor([3, 7, 49])
    with torch.inference_mode():
        want = model.head(model.block(model.embed(ids)))
        assert prepack_linears(model) == 3
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        torch.testing.assert_close(model.head(model.block(model.embed(ids))), want, atol=1e-5, rtol=1e-5)


def test_a_bf16_model_gives_the_same_tokens_whether_or_not_this_cpu_can_pack_bf16():
    # On a CPU without avx512 / avx_ne_convert oneDNN refuses bf16 weights: the layers keep F.linear.
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        replaced = prepack_linears(model)
        assert replaced == (2 if can_prepack(torch.bfloat16) else 0)
        assert torch.equal(model(x), want)


def test_only_the_layers_in_a_dtype_this_cpu_packs_are_replaced(monkeypatch):
    monkeypatch.setattr(cpu_linear, "can_prepack", lambda dtype=torch.float32: dtype == torch.float32)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16).to(torch.bfloat16))
    assert prepack_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_dtype_keeps_a_bf16_checkpoint_in_bf16_only_where_this_cpu_has_a_fast_bf16_matmul(
        tmp_path_factory, monkeypatch, fast_bf16):
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.worker import model_runner
    from pagedserve.testing import make_tiny_model

    path = str(make_tiny_model(tmp_path_factory.mktemp("bf16-llama"), "llama", dtype="bfloat16"))
    # Both kinds of CPU, whichever this one is: without AVX-512 bf16 linears ran 1.3-8x slower than fp32.
    monkeypatch.setattr(model_runner, "can_prepack", lambda dtype=torch.float32: fast_bf16 or dtype == torch.float32)
    auto = LLMEngine.from_pretrained(path, device="cpu")
    assert auto.runner.dtype == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert auto.runner.model.embed_tokens.weight.dtype == auto.runner.dtype
    # An explicit dtype is kept either way.
    assert LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16").runner.dtype == torch.bfloat16
