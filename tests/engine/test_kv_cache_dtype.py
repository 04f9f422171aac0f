"""kv_cache_dtype: the caches in 8 bits buy twice the blocks (and sequences) of a bf16 cache in the same memory,
checkpoint scales reach every layer, and what cannot be served is refused at start naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import kernels
from pagedserve.backend.core.config import CacheConfig
from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model.kv_scales import take_kv_scale
from pagedserve.backend.model.llama import Attention
from pagedserve.testing import make_tiny_model
from pagedserve.testing_pooling import make_tiny_encoder
from tests.support.kv_cache_dtype import agreement, greedy_tokens, make_engine, prompts_for


def test_an_unknown_dtype_is_refused_naming_the_field(tiny_llama_path):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of") as refused:
        make_engine(tiny_llama_path, "int8")
    assert refused.value.field == "kv_cache_dtype"
    with pytest.raises(ConfigError) as refused:
        CacheConfig(kv_cache_dtype="fp16")
    assert refused.value.field == "kv_cache_dtype"


def test_a_device_whose_kernels_cannot_read_fp8_is_refused_at_start_naming_the_field(tiny_llama_path, monkeypatch):
    def unreadable(*args, **kwargs):
        raise NotImplementedError("\"index_select\" not implemented for 'Float8_e4m3fn'")

    monkeypatch.setattr(kernels, "paged_attention", unreadable)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' cannot be read on cpu") as refused:
        make_engine(tiny_llama_path, "fp8")
    assert refused.value.field == "kv_cache_dtype"
    assert make_engine(tiny_llama_path, "auto", num_blocks=8).runner.num_blocks == 8  # auto never probes


@pytest.mark.parametrize(("kv_cache_dtype", "torch_dtype"), [("fp8", torch.float8_e4m3fn),
                                                             ("fp8_e4m3", torch.float8_e4m3fn),
                                                             ("fp8_e5m2", torch.float8_e5m2)])
def test_the_same_memory_buys_exactly_twice_the_blocks_of_a_bf16_cache(tiny_llama_path, kv_cache_dtype,
                                                                       torch_dtype):
    budget = 3 << 20
    bf16 = make_engine(tiny_llama_path, "auto", kv_cache_memory_bytes=budget).runner
    fp8 = make_engine(tiny_llama_path, kv_cache_dtype, kv_cache_memory_bytes=budget).runner
    assert bf16.kv_cache_dtype == torch.bfloat16 and fp8.kv_cache_dtype == torch_dtype
    assert all(cache.dtype == torch_dtype for cache in fp8.key_caches + fp8.value_caches)
    assert fp8.key_caches[0].shape[1:] == bf16.key_caches[0].shape[1:]
    assert 2 * fp8.block_bytes == bf16.block_bytes
    assert fp8.num_blocks == budget // fp8.block_bytes == 2 * bf16.num_blocks  # the budget is a multiple of both
    assert fp8.num_blocks * fp8.block_bytes <= budget


def _peak_running_and_preemptions(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.num_preemptions == 0:
            peak = max(peak, engine.scheduler.num_running)
    return peak, engine.scheduler.num_preemptions


def test_the_scheduler_runs_twice_the_long_sequences_before_it_preempts(tiny_llama_path):
    # Sequences of 64 + 64 tokens end at 8 blocks of 16 each; the bf16 budget holds four of them at full length.
    prompts = [(p * 16)[:64] for p in prompts_for(384, 8, seed=3)]
    bf16_block_bytes = make_engine(tiny_llama_path, "auto", num_blocks=1).runner.block_bytes
    budget = 4 * 8 * bf16_block_bytes

    def run(kv_cache_dtype: str, count: int) -> tuple[int, int]:
        engine = make_engine(tiny_llama_path, kv_cache_dtype, kv_cache_memory_bytes=budget)
        return _peak_running_and_preemptions(engine, prompts[:count], 64)

    assert run("auto", 4) == (4, 0)
    assert run("auto", 8)[1] > 0  # eight grow past the bf16 pool: preempted
    assert run("fp8", 8) == (8, 0)  # twice the sequences, all at once, none preempted


def test_an_encoder_ignores_the_kv_cache_dtype(tmp_path):
    # An encoder keeps no K/V: its embeddings are the same whatever the (empty) cache's dtype.
    path = make_tiny_encoder(tmp_path / "bert", "bert", pooling="mean")
    texts = ["a short text", "another one, a little longer than the first"]
    auto = [out.pooled for out in make_engine(path, "auto", dtype="float32").encode(texts)]
    fp8 = [out.pooled for out in make_engine(path, "fp8", dtype="float32").encode(texts)]
    assert torch.equal(torch.tensor(auto), torch.tensor(fp8))


def _with_kv_scales(source: Path, target: Path, names: dict[str, float]) -> Path:
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    tensors.update({name: torch.tensor(value) for name, value in names.items()})
    save_file(tensors, target / "model.safetensors")
    return target


def test_checkpoint_kv_scales_reach_their_layers_and_the_cache_holds_k_over_the_scale(tiny_llama_path, tmp_path):
    scaled = _with_kv_scales(tiny_llama_path, tmp_path / "scaled", {
        "model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,
        "model.layers.1.self_attn.k_proj.output_scale": 2.0, "model.layers.1.self_attn.v_proj.output_scale": 4.0,
    })
    engine = make_engine(scaled, "fp8", num_blocks=32)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]
    assert [(m.k_scale, m.v_scale) for m in layers] == [(0.5, 0.25), (2.0, 4.0)]
    plain = make_engine(tiny_llama_path, "fp8", num_blocks=32, calculate_kv_scales=False)  # scales 1.0
    prompt = prompts_for(384, 1, seed=5)
    greedy_tokens(engine, prompt, 1)
    greedy_tokens(plain, prompt, 1)
    # The same bf16 keys, stored divided by 0.5 in layer 0: every stored value doubles (within fp8 rounding).
    stored, unscaled = engine.runner.key_caches[0][:2].float(), plain.runner.key_caches[0][:2].float()
    torch.testing.assert_close(stored, 2 * unscaled, rtol=0.13, atol=2**-8)
    assert not torch.equal(stored, unscaled)
    prompts = prompts_for(384, 8, seed=6)
    assert agreement(greedy_tokens(plain, prompts, 4), greedy_tokens(engine, prompts, 4)).identical >= 0.5


@pytest.mark.parametrize(("name", "expected"), [
    ("model.layers.3.self_attn.k_scale", {3: {"k_scale": 1.5}}),
    ("model.layers.3.self_attn.attn.v_scale", {3: {"v_scale": 1.5}}),
    ("model.layers.3.self_attn.k_proj.k_scale", {3: {"k_scale": 1.5}}),
    ("model.layers.3.self_attn.v_proj.output_scale", {3: {"v_scale": 1.5}}),
    ("model.layers.3.self_attn.kv_scale", {3: {"k_scale": 1.5, "v_scale": 1.5}}),
    ("language_model.model.layers.3.self_attn.k_scale", {3: {"k_scale": 1.5}}),
    ("model.layers.3.self_attn.k_proj.weight_scale", {}),
    ("model.layers.3.self_attn.k_proj.input_scale", {}),
    ("vision_tower.vision_model.encoder.layers.3.self_attn.k_proj.output_scale", {}),
])
def test_kv_scale_names_as_vllm_reads_them(name, expected):
    found: dict = {}
    assert take_kv_scale(name, torch.tensor(1.5), found) == bool(expected)
    assert found == expected


def test_a_per_channel_or_non_positive_kv_scale_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale.*4 KV cache scales"):
        take_kv_scale("model.layers.0.self_attn.k_scale", torch.ones(4), {})
    with pytest.raises(ValueError, match="must be positive"):
        take_kv_scale("model.layers.0.self_attn.v_scale", torch.tensor(0.0), {})


@pytest.mark.slow
def test_tensor_parallel_ranks_each_hold_their_heads_in_fp8(tmp_path):
    path = make_tiny_model(tmp_path / "tp", "llama", num_kv_heads=2, num_heads=4)
    engine = make_engine(path, "fp8", tensor_parallel_size=2, num_blocks=64)
    try:
        runner = engine.runner
        assert runner.key_caches[0].dtype == torch.float8_e4m3fn and runner.key_caches[0].shape[2] == 1
        prompts = prompts_for(384, 4, seed=7)
        one_device = make_engine(path, "fp8", num_blocks=64)
        assert agreement(greedy_tokens(one_device, prompts, 6), greedy_tokens(engine, prompts, 6)).identical >= 0.5
    finally:
        engine.shutdown()
