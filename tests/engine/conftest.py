"""Transformers as the oracle: greedy tokens and their fp32 logprobs for one prompt alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


class HFReference:
    """Caches one transformers model per folder and answers greedy continuations."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}

    def model(self, path: Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if path not in self._models:
            self._models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return self._models[path]

    def greedy(self, path: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens (eos ignored) and the fp32 logprob of each."""
        out = self.model(path).generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        logprobs = [
            torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)
        ]
        return tokens, logprobs

    def prompt_logprobs(self, path: Path, prompt_ids: list[int]) -> list[float]:
        """logprob of prompt token i+1 given tokens 0..i, for each i."""
        with torch.no_grad():
            logits = self.model(path)(torch.tensor([prompt_ids])).logits[0].float()
        lps = torch.log_softmax(logits[:-1], -1)
        return lps.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1).tolist()


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    """A session-wide transformers oracle."""
    return HFReference()
