"""Tensor parallelism over gloo on the CPU: two ranks (this process and one spawned worker) give the tokens and
fp32 logprobs of one rank and of transformers under chunked prefill, preemption and prefix hits, for the dense,
Gemma and MoE families and a vocabulary the ranks do not divide (LoRA: test_tensor_parallel_lora.py); what cannot
be split is refused naming the field; a killed worker fails the step with a clear error instead of hanging."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.backend.core.config import ModelConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model.sharding import shard_tensor
from pagedserve.backend.worker.parallel import TIMEOUT_ENV, TensorParallel, TensorParallelError, open_store
from pagedserve.backend.worker.tp_workers import rendezvous, with_rank_threads
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine, greedy
from tests.support.parity import MAX_NEW_TOKENS, SUBMIT_AT_STEP, parity_prompts

# One intra-op thread per rank: two ranks share this machine's cores.
TP2 = {"tensor_parallel_size": 2, "cpu_threads": 1}
STAGGERED = {"block_size": 4, "num_blocks": 24, "max_num_batched_tokens": 8, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def tiny_llama_biased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with biases on every projection, o_proj and down_proj too (row-parallel: added once)."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-llama"), "llama", seed=21, random_norms=True,
                           config_extras={"attention_bias": True, "mlp_bias": True})


@pytest.fixture(scope="module")
def tiny_qwen2_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 (q/k/v biases) with tied embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-qwen2"), "qwen2", seed=22, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_llama_odd_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose 385-token vocabulary (the tokenizer's 384 and one more) two ranks split as 193 + 192 and a
    zero row."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-llama-385"), "llama", seed=27,
                           config_extras={"vocab_size": 385})


@pytest.fixture(scope="module")
def tiny_llama_mqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with one KV head for its 4 query heads: both ranks replicate it."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-llama-mqa"), "llama", seed=26, num_kv_heads=1)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3: per-head q/k norms over head_dim, which every rank keeps whole."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-qwen3"), "qwen3", seed=23, random_norms=True)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Phi-3: its checkpoint stores qkv_proj and gate_up_proj fused, each part split on its own."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-phi3"), "phi3", seed=24, random_norms=True)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma 2: scaled embeddings, soft-capped scores and final logits (the cap over the gathered vocabulary)."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-gemma2"), "gemma2", seed=28, random_norms=True)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma 3: per-head (1 + weight) q/k norms and a local rope base for its sliding layers."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-gemma3"), "gemma3", seed=29, random_norms=True)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mixtral: 8 experts (w1 / w3 / w2), top-2 renormalised."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-mixtral"), "mixtral", seed=30)


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-MoE: 8 experts and a shared expert behind its sigmoid gate."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-qwen2-moe"), "qwen2_moe", seed=31)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _staggered(engine: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    """The parity batch's greedy tokens and their logprobs, requests arriving over several steps."""
    prompts = parity_prompts(engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    final, step = {}, 0
    while len(final) < len(prompts):
        for i, at in enumerate(SUBMIT_AT_STEP):
            if at == step:
                engine.add_request(f"r{i}", None, params, prompt_token_ids=prompts[i])
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                c = out.outputs[0]
                final[out.request_id] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        step += 1
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return final


def _assert_tp2_matches(path: Path, hf_reference) -> None:
    one = cpu_engine(path, **STAGGERED)
    expected = _staggered(one)
    two = cpu_engine(path, **STAGGERED, **TP2)
    try:
        # Each rank caches its half of the KV heads, or the one head it replicates.
        assert two.runner.arch.num_kv_heads == max(1, one.runner.arch.num_kv_heads // 2)
        # Each rank holds its half of the vocabulary's rows, the embedding's and the head's.
        rows, model = -(-one.vocab_size // 2), two.runner.model
        assert model.embed_tokens.weight.shape[0] == model.lm_head.base.out_features == rows
        got = _staggered(two)
    finally:
        two.shutdown()
    prompts = parity_prompts(one.vocab_size)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = got[f"r{i}"]
        ref_tokens, ref_logprobs = hf_reference.greedy(path, prompt, MAX_NEW_TOKENS)
        assert tokens == ref_tokens == expected[f"r{i}"][0], f"prompt {i}"
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert logprobs == pytest.approx(expected[f"r{i}"][1], abs=1e-4)


def test_tp2_llama_with_row_parallel_biases_matches_tp1_and_transformers_as_two_nodes(
        tiny_llama_biased, hf_reference, monkeypatch):
    # Rank 1 started by its own command, as on another node, meeting rank 0 at MASTER_ADDR:MASTER_PORT.
    node = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in {**node, "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert rendezvous() == f"tcp://127.0.0.1:{node['MASTER_PORT']}"
    rank1 = subprocess.Popen([sys.executable, "-m", "pagedserve.backend.worker.tp_workers"],
                             env={**os.environ, **node, "RANK": "1", "LOCAL_RANK": "0"})
    try:
        _assert_tp2_matches(tiny_llama_biased, hf_reference)
        assert rank1.wait(timeout=30) == 0  # told to stop by rank 0's shutdown
    finally:
        rank1.kill()
        rank1.wait()


def test_tp2_qwen2_tied_matches_tp1_and_transformers(tiny_qwen2_tied, hf_reference):
    _assert_tp2_matches(tiny_qwen2_tied, hf_reference)


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_phi3", "tiny_llama_mqa", "tiny_llama_odd_vocab"])
def test_tp2_qwen3_phi3_one_kv_head_and_an_odd_vocab_match_tp1_and_transformers(model_fixture, request, hf_reference):
    _assert_tp2_matches(request.getfixturevalue(model_fixture), hf_reference)


@pytest.mark.parametrize("model_fixture", ["tiny_gemma2", "tiny_gemma3", "tiny_mixtral", "tiny_qwen2_moe"])
def test_tp2_gemma_and_moe_families_match_tp1_and_transformers(model_fixture, request, hf_reference):
    _assert_tp2_matches(request.getfixturevalue(model_fixture), hf_reference)


def test_a_worker_that_exits_before_joining_fails_the_start_at_once():
    import torch
    import torch.distributed as dist

    store = open_store(f"tcp://127.0.0.1:{_free_port()}", is_master=True)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 .* exited with code 1 before joining"):
        TensorParallel(0, 2, store, torch.device("cpu"),
                       liveness=lambda wait: "tensor-parallel worker rank 1 (pid 1) exited with code 1")
    assert time.monotonic() - start < 5 and not dist.is_initialized()


def test_cpu_ranks_split_the_cores_unless_cpu_threads_is_set(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    config = ModelConfig("m", device="cpu", tensor_parallel_size=2)
    assert with_rank_threads(config).cpu_threads == max(1, cores // 2)
    assert with_rank_threads(dataclasses.replace(config, cpu_threads=3)).cpu_threads == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # the other rank on another node
    assert with_rank_threads(config).cpu_threads == cores


def test_shards_of_fused_and_stacked_checkpoint_tensors_take_each_part_apart_and_the_vocab_pads(tiny_phi3):
    import torch

    from pagedserve.backend.model import ModelArchConfig

    cfg = ModelArchConfig.from_pretrained(tiny_phi3)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = torch.arange(q + 2 * kv)[:, None].float()
    shard = shard_tensor("model.layers.0.self_attn.qkv_proj.weight", fused, cfg, 1, 2)
    expected = torch.cat([fused[q // 2 : q], fused[q + kv // 2 : q + kv], fused[q + kv + kv // 2 :]])
    assert torch.equal(shard, expected)
    mqa = dataclasses.replace(cfg, num_kv_heads=1)  # one KV head: both ranks take all of K and V
    q, kv = mqa.num_heads * mqa.head_dim, mqa.head_dim
    fused = torch.arange(q + 2 * kv)[:, None].float()
    shard = shard_tensor("model.layers.0.self_attn.qkv_proj.weight", fused, mqa, 1, 2)
    assert torch.equal(shard, torch.cat([fused[q // 2 : q], fused[q:]]))
    table = torch.arange(5)[:, None].float()  # 5 vocabulary rows: 3 on rank 0, 2 and a zero row on rank 1
    odd = dataclasses.replace(cfg, vocab_size=5)
    assert torch.equal(shard_tensor("lm_head.weight", table, odd, 0, 2), table[:3])
    assert torch.equal(shard_tensor("model.embed_tokens.weight", table, odd, 1, 2), torch.tensor([[3.0], [4], [0]]))
    stacked = torch.arange(2 * 4).view(2, 4, 1).float()  # 2 experts' [gate | up] of 2 rows each, stored stacked
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.gate_up_proj", stacked, cfg, 1, 2),
                       stacked[:, [1, 3]])
    down = torch.arange(2 * 4).view(2, 1, 4).float()
    assert torch.equal(shard_tensor("model.layers.0.mlp.experts.down_proj", down, cfg, 1, 2), down[..., 2:])
    bias = torch.ones(cfg.hidden_size)
    assert torch.equal(shard_tensor("model.layers.0.mlp.down_proj.bias", bias, cfg, 1, 2), torch.zeros_like(bias))
    assert torch.equal(shard_tensor("model.layers.0.mlp.down_proj.bias", bias, cfg, 0, 2), bias)


def test_a_tied_model_s_rank_shares_one_vocabulary_shard_between_embedding_and_head(tiny_qwen2_tied):
    import torch
    from safetensors.torch import load_file

    from pagedserve.backend.model.sharding import load_sharded_model

    table = load_file(str(tiny_qwen2_tied / "model.safetensors"))["model.embed_tokens.weight"]
    model = load_sharded_model(tiny_qwen2_tied, torch.float32, torch.device("cpu"), 64, 1, 2)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, table[table.shape[0] // 2 :])


@pytest.mark.parametrize(("settings", "model_field"), [
    ({"num_heads": 6, "num_kv_heads": 2, "hidden_size": 48}, "num_attention_heads"),  # tp 4
    ({"num_heads": 6, "num_kv_heads": 3, "hidden_size": 48}, "num_key_value_heads"),  # tp 2: 3 neither way
    ({"num_kv_heads": 4, "intermediate_size": 130}, "intermediate_size"),  # tp 4
])
def test_a_size_the_ranks_cannot_split_is_refused_naming_the_field(tmp_path, settings, model_field):
    path = make_tiny_model(tmp_path, "llama", **settings)
    size = 2 if model_field == "num_key_value_heads" else 4
    with pytest.raises(InvalidRequestError, match=model_field) as error:
        cpu_engine(path, tensor_parallel_size=size)
    assert error.value.field == "tensor_parallel_size"


def test_quantization_gguf_quantized_checkpoints_and_an_unsplittable_expert_are_refused_under_tp(tmp_path):
    from tests.support.tiny_gguf import write_model_gguf

    llama = make_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(InvalidRequestError) as error:
        cpu_engine(llama, tensor_parallel_size=2, quantization="int8")
    assert error.value.field == "quantization"
    for bad in (0, 65, True):
        with pytest.raises(InvalidRequestError) as error:
            cpu_engine(llama, tensor_parallel_size=bad)
        assert error.value.field == "tensor_parallel_size"
    gguf = write_model_gguf(llama, tmp_path / "tiny.gguf", lambda name, weight: None)
    gptq = make_tiny_model(tmp_path / "gptq", "llama")
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (gptq / "config.json").write_text(json.dumps(config))
    # Each expert's width is split too: 30 does not go into 4 ranks.
    moe = make_tiny_model(tmp_path / "moe", "qwen2_moe", config_extras={"moe_intermediate_size": 30})
    with pytest.raises(InvalidRequestError, match="moe_intermediate_size") as error:
        cpu_engine(moe, tensor_parallel_size=4)
    assert error.value.field == "tensor_parallel_size"
    for path, what in ((gguf, "GGUF files"), (gptq, "quantized checkpoints")):
        with pytest.raises(InvalidRequestError, match=what) as error:
            cpu_engine(path, tensor_parallel_size=2)
        assert error.value.field == "tensor_parallel_size"


def test_an_idle_worker_outlives_the_collective_timeout_and_a_killed_one_fails_the_step_without_a_hang(
        tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "2")
    path = make_tiny_model(tmp_path, "llama", seed=25)
    engine = cpu_engine(path, num_blocks=32, block_size=4, **TP2)
    try:
        (worker,) = engine.workers.processes
        (first,) = engine.generate([5, 6, 7], greedy(3))
        time.sleep(3)  # idle past the timeout: the worker waits for the next plan without one
        (again,) = engine.generate([5, 6, 7], greedy(3))
        assert again.error is None and again.outputs[0].token_ids == first.outputs[0].token_ids
        engine.add_request("before", None, greedy(40), prompt_token_ids=[5, 6, 7, 8])
        assert engine.step()[0].error is None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        outputs = []
        while not outputs:
            outputs = [out for out in engine.step() if out.finished]
        assert time.monotonic() - start < 10
        (out,) = outputs
        assert "tensor-parallel worker rank 1" in out.error and "exited with code -9" in out.error, out.error
        engine.add_request("after", None, greedy(4), prompt_token_ids=[5, 6])
        (after,) = engine.step()
        assert after.finished and "cannot run further steps" in after.error
    finally:
        start = time.monotonic()
        engine.shutdown()
        engine.shutdown()  # a second call finds nothing left to stop
        assert time.monotonic() - start < 10


def test_the_gpu_checks_tp_part_runs_as_its_dry_run_two_cpu_ranks_equal_to_one(tmp_path):
    script = Path(__file__).resolve().parents[2] / "bench" / "tp_gpu.py"
    env = {**os.environ, "PAGEDSERVE_KERNELS": "auto"}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], check=True, env=env,
                   timeout=300, capture_output=True)
    record = json.loads((tmp_path / "tp_gpu.json").read_text())
    assert record["greedy_equal_fraction"] == 1.0
    assert record["tp1"]["tensor_parallel_size"] == 1 and record["tp2"]["tensor_parallel_size"] == 2
    assert record["tp1"]["batched_tok_s"] > 0 and record["tp2"]["batched_tok_s"] > 0
