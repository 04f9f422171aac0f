"""Speculative decoding: a proposer drafts each running sequence's next tokens before the schedule (n-gram
prompt lookup in `ngram.py`, a draft model in `draft_model.py`), the target scores them in the step's one
forward, and `verify.py` keeps the longest run the target's own sampling agrees with."""

from __future__ import annotations

from typing import Any

from pagedserve.backend.engine.spec_decode.draft_model import DraftModelSpeculator
from pagedserve.backend.engine.spec_decode.ngram import NgramSpeculator, can_speculate, ngram_lookup
from pagedserve.backend.engine.spec_decode.verify import Run, StepSample, record_run, sample_step

__all__ = [
    "DraftModelSpeculator",
    "NgramSpeculator",
    "Run",
    "StepSample",
    "can_speculate",
    "make_speculator",
    "ngram_lookup",
    "record_run",
    "sample_step",
]


def make_speculator(config: Any, engine: Any) -> NgramSpeculator | None:
    """The engine's proposer for `config` (a SpeculativeConfig, or None: no speculation); `engine` is the
    EngineCore whose runner, scheduler and configs a draft model shares."""
    if config is None:
        return None
    if config.method == "draft_model":
        return DraftModelSpeculator(config, engine)
    return NgramSpeculator(config, engine.scheduler_config.max_model_len)
