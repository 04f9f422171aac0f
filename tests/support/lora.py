"""LoRA tests' oracle (transformers + peft) and shared runs, for the single-rank and the tensor-parallel tests."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.backend.core.outputs import RequestOutput
from pagedserve.backend.engine.llm_engine import LLMEngine
from tests.support.engines import greedy, run_to_end

ATTENTION_AND_DOWN = ("q_proj", "v_proj", "o_proj", "down_proj")


class PeftReference:
    """transformers + peft as the oracle: one fp32 PeftModel per (base, adapter), loaded once."""

    def __init__(self) -> None:
        self._models: dict[tuple[Path, Path | None], torch.nn.Module] = {}

    def model(self, base: Path, adapter: Path | None) -> torch.nn.Module:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        key = (Path(base), None if adapter is None else Path(adapter))
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            self._models[key] = (model if adapter is None else PeftModel.from_pretrained(model, adapter)).eval()
        return self._models[key]

    def generate(self, base: Path, adapter: Path | None, prompt: list[int], **settings) -> torch.Tensor:
        return self.model(base, adapter).generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, pad_token_id=0, eos_token_id=None, **settings)

    def greedy(self, base: Path, adapter: Path | None, prompt: list[int], max_new_tokens: int):
        """Greedy tokens and the fp32 logprob of each."""
        out = self.generate(base, adapter, prompt, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)]
        return tokens, logprobs


def run_with_a_late_repeat(engine: LLMEngine, names: list[str | None], prompts: list[list[int]],
                           max_tokens: int) -> dict[str, RequestOutput]:
    """Greedy requests r0..r3 (logprobs on) under `names` (base, a1, a2, a1): the first three at once, the
    repeat of a1 once a2 runs (with one slot: a1, a2, a1 in turn); every final output by request id."""

    def submit(i: int) -> None:
        engine.add_request(f"r{i}", None, greedy(max_tokens, logprobs=0, lora_name=names[i]),
                           prompt_token_ids=prompts[i])

    for i in range(3):
        submit(i)
    final = {}
    for _ in range(64):
        if "a2" in engine.get_stats().running_lora_adapters:
            break
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    assert "r2" not in final and "a2" in engine.get_stats().running_lora_adapters
    submit(3)
    final.update(run_to_end(engine))
    return final
