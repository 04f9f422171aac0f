"""What the 8-bit KV cache tests and bench/kv_cache.py measure: greedy agreement of an fp8-KV engine with the
model-dtype-KV engine (first divergence per sequence), and the KL of their first-token distributions in a seeded
sampled run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine


def prompts_for(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` token prompts of 4 to 19 tokens drawn from the vocabulary (special ids 0..3 left out)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab_size, (4 + i % 16,), generator=gen).tolist() for i in range(count)]


def make_engine(path: str | Path, kv_cache_dtype: str, **settings: Any) -> LLMEngine:
    """A CPU engine over `path` in bf16 (the issue's baseline: a bf16 KV cache) with this KV cache dtype."""
    options = {"dtype": "bfloat16", "device": "cpu", "kv_cache_memory_bytes": 16 << 20, **settings}
    return LLMEngine.from_pretrained(str(path), kv_cache_dtype=kv_cache_dtype, **options)


def greedy_tokens(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of max_tokens tokens (eos ignored), all prompts in one batch."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = engine.generate(list(prompts), params)
    return [out.outputs[0].token_ids for out in outputs]


def first_divergence(base: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where two token sequences differ; None when identical."""
    for position, (a, b) in enumerate(zip(base, other, strict=True)):
        if a != b:
            return position
    return None


@dataclass(frozen=True)
class Agreement:
    """Greedy agreement of one engine with another over the same prompts."""

    divergences: list[int | None]  # per sequence: first differing position, None when identical

    @property
    def identical(self) -> float:
        """Fraction of sequences identical to the end."""
        return sum(d is None for d in self.divergences) / len(self.divergences)

    def describe(self) -> str:
        """The identical fraction and the sorted first-divergence positions of the others."""
        diverged = sorted(d for d in self.divergences if d is not None)
        return f"{self.identical:.0%} identical; first divergence at {diverged}"


def agreement(base: list[list[int]], other: list[list[int]]) -> Agreement:
    """Per-sequence first divergence of `other` from `base`."""
    return Agreement([first_divergence(a, b) for a, b in zip(base, other, strict=True)])


def first_token_logits(engine: LLMEngine, prompts: Sequence[list[int]], seed: int = 0) -> tuple[torch.Tensor,
                                                                                                  list[int]]:
    """A seeded sampled run (temperature 1, seed + i for prompt i): the fp32 logits each prompt's first token was
    sampled from [N, V], and the sampled first tokens."""
    captured: dict[str, torch.Tensor] = {}
    execute = engine.runner.execute

    def recording(scheduler_output):
        out = execute(scheduler_output)
        for request_id, row in zip(out.sample_request_ids, out.sample_logits, strict=True):
            captured.setdefault(request_id, row.float().clone())
        return out

    engine.runner.execute = recording
    try:
        ids = []
        for i, prompt in enumerate(prompts):
            ids.append(f"kl-{seed}-{i}")
            engine.add_request(ids[-1], None, SamplingParams(temperature=1.0, seed=seed + i, max_tokens=1),
                               prompt_token_ids=prompt)
        sampled = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    sampled[out.request_id] = out.outputs[0].token_ids[0]
    finally:
        engine.runner.execute = execute
    return torch.stack([captured[i] for i in ids]), [sampled[i] for i in ids]


def mean_kl(base_logits: torch.Tensor, other_logits: torch.Tensor) -> float:
    """Mean over rows of KL(base || other) of the softmax distributions."""
    base, other = base_logits.log_softmax(-1), other_logits.log_softmax(-1)
    return float((base.exp() * (base - other)).sum(-1).mean())
