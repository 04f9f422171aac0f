"""The engine with LoRA adapters forced onto the Triton kernels (CPU interpreter) still equals transformers + peft:
the fused projections' parts expand from strided slices of one shrink, and base rows are left alone."""

from __future__ import annotations

import torch

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.kernels.lora import triton as lora_triton
from pagedserve.testing import make_lora_adapter
from tests.support.kernel_checks import spy

PROMPT = [5, 17, 33, 90, 41, 7, 250, 3, 64, 12, 8]
MAX_NEW_TOKENS = 3


def _peft_greedy(base, adapter, prompt: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_lora_engine_on_triton_kernels_matches_peft(tiny_llama_path, tmp_path, monkeypatch, hf_reference):
    adapter = make_lora_adapter(tiny_llama_path, tmp_path / "a", rank=8, seed=5)
    shrinks = spy(monkeypatch, lora_triton, "lora_shrink")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    engine = LLMEngine.from_pretrained(str(tiny_llama_path), dtype="float32", device="cpu", block_size=16,
                                       num_blocks=8, max_num_batched_tokens=8, enable_lora=True,
                                       lora_modules={"a": str(adapter)})
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, lora_name=name)
              for name in ("a", None)]
    with_adapter, base = engine.generate([PROMPT, PROMPT], params)
    assert shrinks, "the Triton shrink kernel never ran"
    assert with_adapter.outputs[0].token_ids == _peft_greedy(tiny_llama_path, adapter, PROMPT)
    assert base.outputs[0].token_ids == hf_reference.greedy(tiny_llama_path, PROMPT, MAX_NEW_TOKENS)[0]
