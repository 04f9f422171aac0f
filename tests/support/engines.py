"""The in-process engine the tests build: fp32 on the CPU, so its tokens can equal transformers' exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.backend.core.outputs import RequestOutput
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine


def cpu_engine(path: Path, **settings: Any) -> LLMEngine:
    """An fp32 CPU LLMEngine over the model folder `path`; `settings` are from_pretrained's (dtype too)."""
    return LLMEngine.from_pretrained(str(path), **{"dtype": "float32", "device": "cpu", **settings})


def greedy(max_tokens: int = 12, **kwargs: Any) -> SamplingParams:
    """Greedy, ignoring eos: `max_tokens` tokens whatever the random weights say."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until no request is left; each request's final output by id."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final
