"""Multi-LoRA under tensor parallelism over gloo on the CPU: two ranks serving a batch of two adapters and the base
model give the tokens and fp32 logprobs of one rank and of transformers + peft, adapters swapping through one slot
too (rank 0's loads mirrored by the worker); a worker that cannot read an adapter fails the step naming why."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model import ModelArchConfig
from pagedserve.backend.model.lora import load_lora_adapter
from pagedserve.backend.model.sharding import shard_lora_pair
from pagedserve.backend.worker.parallel import LoRAPlan
from pagedserve.testing import make_lora_adapter, make_tiny_model
from tests.support.engines import cpu_engine, greedy, run_to_end
from tests.support.lora import ATTENTION_AND_DOWN, PeftReference, run_with_a_late_repeat

TP2 = {"tensor_parallel_size": 2, "cpu_threads": 1}
MAX_NEW_TOKENS = 6
NAMES = [None, "a1", "a2", "a1"]


@pytest.fixture(scope="module")
def peft_reference() -> PeftReference:
    return PeftReference()


@pytest.fixture(scope="module")
def mqa_biased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with one KV head (both ranks replicate it) and biases on every projection, o_proj and down_proj too."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-lora-llama"), "llama", seed=41, num_kv_heads=1,
                           config_extras={"attention_bias": True, "mlp_bias": True})


def _adapters(base: Path, root: Path) -> dict[str, Path]:
    """a1: rank 8 on all seven projections; a2: rank 16, rsLoRA, on attention and down_proj only."""
    return {"a1": make_lora_adapter(base, root / "a1", rank=8, seed=1),
            "a2": make_lora_adapter(base, root / "a2", rank=16, seed=2, use_rslora=True, alpha=8,
                                    targets=ATTENTION_AND_DOWN)}


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(11 + 3 * i)] for i in range(n)]


def _run(engine: LLMEngine) -> dict[int, tuple[list[int], list[float]]]:
    """The greedy tokens and logprobs of base, a1, a2 and a1 requests, the second a1 arriving once a2 runs (with
    one slot: a1, a2, a1 in turn)."""
    final = run_with_a_late_repeat(engine, NAMES, _prompts(len(NAMES)), MAX_NEW_TOKENS)
    results = {}
    for i in range(len(NAMES)):
        assert final[f"r{i}"].error is None, final[f"r{i}"].error
        c = final[f"r{i}"].outputs[0]
        results[i] = (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
    return results


def _assert_tp2_lora_matches(base: Path, adapters: dict[str, Path], peft_reference: PeftReference,
                             **settings) -> tuple[LLMEngine, list[LoRAPlan]]:
    """TP=2 equals TP=1 and peft per request; returns the (shut down) TP=2 engine and the LoRA plans rank 0
    sent."""
    settings = {"enable_lora": True, "max_lora_rank": 16, "block_size": 4, "num_blocks": 64,
                "lora_modules": {name: str(path) for name, path in adapters.items()}, **settings}
    expected = _run(cpu_engine(base, **settings))
    two = cpu_engine(base, **settings, **TP2)
    plans, broadcast = [], two.runner.tp.broadcast
    two.runner.tp.broadcast = lambda plan: (plan is not None and plans.append(plan.lora)) or broadcast(plan)
    try:
        got = _run(two)
    finally:
        two.shutdown()
    prompts = _prompts(len(NAMES))
    for i, name in enumerate(NAMES):
        tokens, logprobs = peft_reference.greedy(base, adapters.get(name), prompts[i], MAX_NEW_TOKENS)
        assert got[i][0] == tokens == expected[i][0], f"request {i} (adapter {name})"
        assert got[i][1] == pytest.approx(logprobs, abs=1e-4)
        assert got[i][1] == pytest.approx(expected[i][1], abs=1e-4)
    base_alone = peft_reference.greedy(base, None, prompts[1], MAX_NEW_TOKENS)[0]
    assert got[1][0] != base_alone, "the adapter must change the output for this test to mean anything"
    return two, plans


def test_tp2_two_adapters_and_the_base_in_one_batch_match_tp1_and_peft(tiny_llama_path, tmp_path, peft_reference):
    two, _ = _assert_tp2_lora_matches(tiny_llama_path, _adapters(tiny_llama_path, tmp_path), peft_reference,
                                      max_loras=2)
    # o_proj's LoRA sits inside its all-reduce, q|k|v's on the column-parallel projection itself.
    attention = two.runner.model.layers[0].self_attn
    assert type(attention.o_proj).__name__ == "RowParallelLinear"
    assert type(attention.o_proj.base).__name__ == type(attention.qkv_proj).__name__ == "LoRALinear"


def test_tp2_adapters_swapping_through_one_slot_on_a_replicated_kv_head_with_biases_match_tp1_and_peft(
        mqa_biased, tmp_path, peft_reference):
    adapters = _adapters(mqa_biased, tmp_path)
    two, plans = _assert_tp2_lora_matches(mqa_biased, adapters, peft_reference, max_loras=1, max_cpu_loras=1,
                                          max_num_batched_tokens=16)
    assert two.runner.lora.num_loads >= 3, "a1, a2 and a1 again take the single slot in turn"
    # Each load reached the worker once, as a name and a path (no weights), with the rows' slots.
    loads = [load for plan in plans for load in plan.loads]
    assert [(slot, name, path) for slot, _, name, path in loads][:3] == [
        (0, "a1", str(adapters["a1"])), (0, "a2", str(adapters["a2"])), (0, "a1", str(adapters["a1"]))]
    assert len(loads) == two.runner.lora.num_loads
    assert all(plan.slots is None or plan.slots.dtype == torch.int32 for plan in plans)


def test_a_rank_s_adapter_shard_holds_b_rows_of_its_output_or_a_columns_of_its_input(mqa_biased, tmp_path):
    full = ModelArchConfig.from_pretrained(mqa_biased)
    adapter = load_lora_adapter("a1", _adapters(mqa_biased, tmp_path)["a1"], full, 16)
    q_a, q_b = adapter.weights[(0, "q_proj")]
    a, b = shard_lora_pair("q_proj", q_a, q_b, full, 1, 2)
    assert a is q_a and torch.equal(b, q_b[q_b.shape[0] // 2 :])
    k_a, k_b = adapter.weights[(0, "k_proj")]  # the one KV head: both ranks keep all of B
    assert torch.equal(shard_lora_pair("k_proj", k_a, k_b, full, 1, 2)[1], k_b)
    d_a, d_b = adapter.weights[(0, "down_proj")]
    a, b = shard_lora_pair("down_proj", d_a, d_b, full, 1, 2)
    assert torch.equal(a, d_a[:, d_a.shape[1] // 2 :]) and b is d_b


def test_a_worker_that_cannot_read_an_adapter_fails_the_step_naming_why(tiny_llama_path, tmp_path):
    adapter = make_lora_adapter(tiny_llama_path, tmp_path / "gone", rank=4, seed=3, targets=("q_proj",))
    engine = cpu_engine(tiny_llama_path, enable_lora=True, block_size=4, num_blocks=32,
                        lora_modules={"gone": str(adapter)}, **TP2)
    try:
        shutil.rmtree(adapter)  # rank 0 keeps its host copy from the start; the worker reads at the first use
        engine.add_request("r", None, greedy(4, lora_name="gone"), prompt_token_ids=_prompts(1)[0])
        start = time.monotonic()
        (out,) = [out for out in run_to_end(engine).values()]
        assert time.monotonic() - start < 10
        assert "rank 1 cannot load a LoRA adapter" in out.error and "no such folder" in out.error, out.error
        assert "cannot run further steps" in engine.failure()
    finally:
        engine.shutdown()
