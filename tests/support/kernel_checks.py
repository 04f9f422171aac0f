"""Tolerances and markers shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import native

needs_native = pytest.mark.skipif(native.load() is None, reason="no C++ compiler for the native kernels")
# The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one bf16 step of slack.
TRITON_BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}


def triton_tol(dtype: torch.dtype) -> dict:
    """How close an element-wise Triton kernel under the interpreter stays to its torch reference."""
    return TRITON_BF16_TOL if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}


def assert_native_matches_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: to rounding of a reordered sum; bf16: at most one bf16 ulp apart, and nearly all bit-equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=2 ** -7)
    assert (actual != expected).float().mean() < 0.02


def spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[tuple]:
    """Replace owner.name by a wrapper that records each call's arguments and forwards it; returns the record."""
    calls: list[tuple] = []
    real = getattr(owner, name)

    def recording(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def greedy_on_triton(monkeypatch: pytest.MonkeyPatch, path: object, prompts: list[list[int]],
                     max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from an fp32 CPU engine forced onto the Triton kernels (the interpreter); a
    10-token budget chunks the longer prompts, so steps mix a prefill chunk with decodes."""
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", block_size=16, num_blocks=8,
                                       max_num_batched_tokens=10, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=ids)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [final[f"r{i}"] for i in range(len(prompts))]


def compile_for_sm90(script: str) -> list[dict]:
    """Run `script` (which prints one JSON list of compile_launch records last) in a fresh interpreter: here the
    kernels were decorated for TRITON_INTERPRET and cannot compile. Returns the records."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDSERVE_KERNELS")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
