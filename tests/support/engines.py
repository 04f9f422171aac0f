"""The in-process engine the tests build: fp32 on the CPU, so its tokens can equal transformers' exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.backend.engine.llm_engine import LLMEngine


def cpu_engine(path: Path, **settings: Any) -> LLMEngine:
    """An fp32 CPU LLMEngine over the model folder `path`; `settings` are from_pretrained's (dtype too)."""
    return LLMEngine.from_pretrained(str(path), **{"dtype": "float32", "device": "cpu", **settings})
