"""transformers as the oracle: greedy tokens and their fp32 logprobs, prompt logprobs and beam hypotheses for
one prompt alone, with one fp32 model cached per folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class HFReference:
    """Caches one transformers model per folder and answers what it would generate."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}

    def model(self, path: Path) -> torch.nn.Module:
        """The fp32 transformers model of `path`, loaded once."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if path not in self._models:
            self._models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return self._models[path]

    def _generate(self, path: Path, prompt_ids: list[int], max_new_tokens: int, **settings: Any) -> Any:
        return self.model(path).generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **settings,
        )

    def greedy(self, path: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens (eos ignored) and the fp32 logprob of each."""
        out = self._generate(path, prompt_ids, max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)
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

    def beams(self, path: Path, prompt_ids: list[int], width: int, max_new_tokens: int, length_penalty: float,
              eos_token_id: int | None = None) -> list[list[int]]:
        """The `width` hypotheses of num_beams search, best first, each cut after its eos."""
        out = self._generate(path, prompt_ids, max_new_tokens, num_beams=width, num_return_sequences=width,
                             eos_token_id=eos_token_id, length_penalty=length_penalty)
        beams = [seq[len(prompt_ids) :].tolist() for seq in out]
        # transformers pads hypotheses that ended early; ours end at their eos.
        return [b[: b.index(eos_token_id) + 1] if eos_token_id in b else b for b in beams]
