"""What the vision-language families' engine tests share: an fp32 engine on a tiny folder, each prompt's greedy
tokens with all queued at once, and transformers' greedy continuation of the same prompts and images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine

Prompts = list[tuple[str, list[Any]]]  # (text with one placeholder an image, its images)


def vlm_engine(path: Path, **kwargs: Any) -> LLMEngine:
    """An fp32 CPU engine on the folder, max_model_len 256, `kwargs` on top."""
    return LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", max_model_len=256, **kwargs)


def completions(engine: LLMEngine, prompts: Prompts, params: SamplingParams, prefix: str = "r") -> list[list[list[int]]]:
    """Each prompt's completions' token ids (n of them) under `params`, all queued at once."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, (prompt, images) in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params, images=images)
    final = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [[list(c.token_ids) for c in final[rid].outputs] for rid in ids]


def greedy_tokens(engine: LLMEngine, prompts: Prompts, params: SamplingParams, prefix: str = "r") -> list[list[int]]:
    """Each prompt's first completion's token ids under `params`, all queued at once."""
    return [first for first, *_ in completions(engine, prompts, params, prefix)]


def transformers_greedy(reference: Any, processor: Any, prompts: Prompts, max_new: int,
                        nested: bool = False) -> list[list[int]]:
    """transformers' greedy continuation of each prompt with its images (`nested`: the processor takes one list of
    images a text, as Idefics3's does)."""
    outs = []
    for prompt, images in prompts:
        inputs = processor(text=prompt, images=[images] if nested else images, return_tensors="pt")
        out = reference.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        outs.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return outs
