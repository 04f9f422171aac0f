"""Multi-LoRA serving: batches mixing the base model and adapters equal transformers + peft per request, under
preemption, chunked prefill and adapter swaps; the prefix cache never crosses adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.testing import make_lora_adapter
from tests.support.engines import cpu_engine, greedy
from tests.support.lora import ATTENTION_AND_DOWN, PeftReference, run_with_a_late_repeat

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def peft_reference() -> PeftReference:
    return PeftReference()


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory) -> dict[str, Path]:
    """a1: rank 8 on all seven projections; a2: rank 16, rsLoRA, on attention and down_proj only."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a1": make_lora_adapter(tiny_llama_path, root / "a1", rank=8, seed=1),
        "a2": make_lora_adapter(tiny_llama_path, root / "a2", rank=16, seed=2, use_rslora=True, alpha=8,
                                targets=ATTENTION_AND_DOWN),
    }


def _prompts(n: int, length: int = 13) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(length + 3 * i)] for i in range(n)]


SETTINGS = {
    "roomy": dict(max_loras=2, num_blocks=64),
    "preemption+chunked": dict(max_loras=2, num_blocks=14, max_num_batched_tokens=8),
    "swaps": dict(max_loras=1, max_cpu_loras=1, num_blocks=64, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_batch_matches_peft_per_request(setting, tiny_llama_path, adapters, peft_reference):
    engine = cpu_engine(tiny_llama_path, enable_lora=True, block_size=4, max_lora_rank=16,
                        lora_modules={name: str(path) for name, path in adapters.items()}, **SETTINGS[setting])
    names = [None, "a1", "a2", "a1"]
    prompts = _prompts(len(names))
    final = run_with_a_late_repeat(engine, names, prompts, MAX_NEW_TOKENS)
    outputs = {}
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        completion = final[f"r{i}"].outputs[0]
        tokens, logprobs = peft_reference.greedy(tiny_llama_path, adapters.get(name), prompt, MAX_NEW_TOKENS)
        assert completion.token_ids == tokens, f"request {i} (adapter {name})"
        got = [lp[t] for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-4)
        outputs[i] = tokens
    base_alone = peft_reference.greedy(tiny_llama_path, None, prompts[1], MAX_NEW_TOKENS)[0]
    assert outputs[1] != base_alone, "the adapter must change the output for this test to mean anything"
    if setting == "preemption+chunked":
        assert engine.get_stats().num_preemptions > 0
    if setting == "swaps":
        assert engine.runner.lora.num_loads >= 3, "a1, a2 and a1 again take the single slot in turn"


def test_n_and_beams_with_an_adapter_fork_its_adapter(tiny_llama_path, adapters, peft_reference):
    engine = cpu_engine(tiny_llama_path, enable_lora=True, max_loras=1, lora_modules={"a2": str(adapters["a2"])},
                        block_size=4, num_blocks=64)
    prompt = _prompts(1)[0]
    n2, beams = engine.generate([prompt, prompt], [
        greedy(MAX_NEW_TOKENS, n=2, lora_name="a2"),
        SamplingParams(beam_width=2, n=2, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, lora_name="a2"),
    ])
    tokens = peft_reference.greedy(tiny_llama_path, adapters["a2"], prompt, MAX_NEW_TOKENS)[0]
    assert [c.token_ids for c in n2.outputs] == [tokens, tokens]
    ref = peft_reference.generate(tiny_llama_path, adapters["a2"], prompt, max_new_tokens=MAX_NEW_TOKENS,
                                  num_beams=2, num_return_sequences=2, min_new_tokens=MAX_NEW_TOKENS)
    assert [c.token_ids for c in beams.outputs] == [seq[len(prompt):].tolist() for seq in ref]


def test_prefix_cache_hits_within_an_adapter_never_across(tiny_llama_path, adapters):
    engine = cpu_engine(tiny_llama_path, enable_lora=True, max_loras=2, block_size=4, num_blocks=64,
                        lora_modules={name: str(path) for name, path in adapters.items()})
    prompt = _prompts(1, length=17)[0]

    def cached(name: str | None) -> int:
        return engine.generate([prompt], greedy(2, lora_name=name))[0].num_cached_tokens

    assert cached("a1") == 0
    assert cached("a2") == 0, "another adapter's blocks are not this one's"
    assert cached(None) == 0, "nor the base model's"
    assert cached("a1") == 16, "the same adapter hits its own four full blocks"
    assert cached(None) == 16
    engine.remove_lora("a1")
    engine.add_lora("a1", str(adapters["a2"]))  # the same name, other weights: the old blocks are stale
    assert cached("a1") == 0


def test_lora_work_is_skipped_where_no_adapter_of_the_step_applies(tiny_llama_path, adapters, monkeypatch):
    from pagedserve import kernels
    from pagedserve.kernels.lora import cpu as lora_cpu

    engine = cpu_engine(tiny_llama_path, enable_lora=True, num_blocks=32,
                        lora_modules={name: str(path) for name, path in adapters.items()})
    calls = []
    # A projection with LoRA work makes one of these calls (the prepared native one on the CPU).
    for owner, op in ((kernels, "lora_shrink"), (kernels, "lora_shrink_expand_add"),
                      (lora_cpu.NativeProjection, "__call__")):
        monkeypatch.setattr(owner, op, lambda *args, _op=getattr(owner, op): calls.append(1) or _op(*args))
    engine.generate([_prompts(1)[0]], greedy(3))
    assert calls == [] and engine.runner.lora.step.slots is None
    engine.generate([_prompts(1)[0]], greedy(1, lora_name="a1"))
    assert len(calls) == 4 * engine.runner.arch.num_layers, "a1 adapts all four projections of every layer"
    calls.clear()
    engine.generate([_prompts(1)[0]], greedy(1, lora_name="a2"))
    assert len(calls) == 3 * engine.runner.arch.num_layers, "a2 has no gate_proj or up_proj: gate_up_proj is skipped"


FAMILIES = {
    "qwen2": ("q_proj", "k_proj", "v_proj", "up_proj"),  # QKV bias; a fused projection with one part adapted
    "qwen3": ("q_proj", "v_proj", "o_proj", "gate_proj"),  # head_dim != hidden_size / num_heads
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # checkpoints and adapters with fused targets
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),  # experts' MLPs are not wrapped; attention is
}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_other_families_match_peft(arch, tmp_path, peft_reference):
    from pagedserve.testing import make_tiny_model

    base = make_tiny_model(tmp_path / arch, arch, seed=6)
    adapter = make_lora_adapter(base, tmp_path / "adapter", rank=8, seed=7, targets=FAMILIES[arch])
    engine = cpu_engine(base, enable_lora=True, block_size=4, num_blocks=32, lora_modules={"a": str(adapter)})
    prompt = _prompts(1)[0]
    with_adapter, without = engine.generate([prompt, prompt], [greedy(MAX_NEW_TOKENS, logprobs=0, lora_name="a"),
                                                               greedy(MAX_NEW_TOKENS)])
    tokens, logprobs = peft_reference.greedy(base, adapter, prompt, MAX_NEW_TOKENS)
    assert with_adapter.outputs[0].token_ids == tokens
    got = [lp[t] for lp, t in zip(with_adapter.outputs[0].logprobs, tokens, strict=True)]
    assert got == pytest.approx(logprobs, abs=1e-4)
    assert without.outputs[0].token_ids == peft_reference.greedy(base, None, prompt, MAX_NEW_TOKENS)[0] != tokens


def test_a_step_lays_each_adapters_rows_out_together(tiny_llama_path, adapters):
    engine = cpu_engine(tiny_llama_path, enable_lora=True, max_loras=2, block_size=4, num_blocks=64,
                        lora_modules={name: str(path) for name, path in adapters.items()})
    for i, name in enumerate(["a1", None, "a2", "a1", None]):
        engine.add_request(f"r{i}", None, greedy(4, lora_name=name), prompt_token_ids=_prompts(5)[i])
    engine.step()  # a1's requests and the base ones; a2 (a second load) waits a step
    engine.step()  # decodes of r0, r1, r3, r4 and r2's prompt: a1's rows r0 and r3 are not neighbours
    groups = engine.runner.lora.step.groups.groups
    assert len(groups) == 2 and all(isinstance(rows, slice) for _, rows in groups), groups
