"""Structured outputs: offline tokens/s with and without a JSON schema on every request, the time to compile a
schema (new and cached), and the per-step cost of the grammar mask.

One seeded workload (random mid-vocabulary prompt ids, temperature 1.0, a seed per request, max_tokens fixed,
ignore_eos) runs at batch 1, 8 and 32 (B requests submitted together, `rounds` times) on the CPU engine,
unconstrained and with SCHEMA on every request, `repeats` of each in ABBA order. Constrained outputs stop
when the JSON ends, so tokens/s is compared, not wall time. The mask cost replays one constrained output's
tokens through R matchers and times StructuredOutputs.apply on [R, V] fp32 logits, and each of its parts.

    python bench/structured.py           # default model, 3 ABBA repeats (about 3.5 minutes on 2 shared cores)
    python bench/structured.py --quick   # 1 repeat, shorter outputs (about 30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "structured.json"
BATCH_SIZES = (1, 8, 32)
MASK_ROWS = (1, 8, 32)
# A record with free strings and a list long enough that most outputs run to max_tokens, as unconstrained ones do.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 12},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}


def make_prompts(num: int, seed: int, vocab_size: int, prompt_len: int) -> list[list[int]]:
    """Seeded prompt token ids from the middle of the vocabulary (ordinary tokens, no special ones)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, vocab_size - 1000, prompt_len).tolist() for _ in range(num)]


def fresh_schema(index: int) -> dict:
    """SCHEMA with one property renamed: a spec the compile cache has not seen."""
    properties = dict(SCHEMA["properties"])
    properties[f"field_{index}"] = properties.pop("email")
    return {**SCHEMA, "properties": properties, "required": ["name", "age", f"field_{index}", "tags"]}


class StepTimes:
    """Seconds one run spends in the calls structured outputs adds (apply, accept_token) or changes (sampler)."""

    def __init__(self) -> None:
        self.totals = {"apply": 0.0, "accept_token": 0.0, "sampler": 0.0}

    def wrap(self, key: str, function: Callable) -> Callable:
        """`function`, adding its wall time to totals[key]."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - start
        return timed


@contextmanager
def timing(engine: Any) -> Iterator[StepTimes]:
    """Time engine.structured.apply, every matcher's accept_token and the sampler while the block runs."""
    from pagedserve.backend.structured import GrammarState

    times = StepTimes()
    sampler_class = type(engine.sampler)  # called as engine.sampler(...): __call__ is looked up on the class
    originals = (GrammarState.accept_token, sampler_class.__call__)
    engine.structured.apply = times.wrap("apply", engine.structured.apply)
    GrammarState.accept_token = times.wrap("accept_token", originals[0])
    sampler_class.__call__ = times.wrap("sampler", originals[1])
    try:
        yield times
    finally:
        del engine.structured.apply  # the instance attribute shadowed the method
        GrammarState.accept_token, sampler_class.__call__ = originals


def run_generation(engine: Any, prompts: list[list[int]], batch: int, max_tokens: int,
                   schema: dict | None) -> dict:
    """Generate `prompts` `batch` at a time; tokens/s, how outputs ended, and the time in each timed call."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    spec = {"json": schema} if schema is not None else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=spec) for i in range(len(prompts))]
    completions = []
    with timing(engine) as times:
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(0, len(prompts), batch):
            completions += [o.outputs[0] for o in engine.generate(prompts[i:i + batch], params[i:i + batch])]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(c.token_ids) for c in completions)
    return {
        "seconds": round(seconds, 3), "output_tokens": tokens, "tok_s": round(tokens / seconds, 2),
        # With one thread, CPU time leaves out the time other jobs held the core: steadier on a shared machine.
        "cpu_seconds": round(cpu_seconds, 3), "tok_per_cpu_s": round(tokens / cpu_seconds, 2),
        "mean_output_len": round(tokens / len(completions), 1),
        "stopped_on_grammar_end": sum(c.finish_reason == "stop" for c in completions),
        "num_requests": len(completions),
        **{f"{key}_s": round(value, 3) for key, value in times.totals.items()},
    }


def compare_throughput(engine: Any, prompts: list[list[int]], batch: int, max_tokens: int,
                       repeats: int) -> dict:
    """Unconstrained and constrained runs, `repeats` of each in ABBA order; the ratio of their median tokens/s."""
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for repeat in range(repeats):
        # ABBA order: a drift of the machine's load over the run falls on both modes alike.
        for mode in (("unconstrained", "constrained") if repeat % 2 == 0 else ("constrained", "unconstrained")):
            schema = SCHEMA if mode == "constrained" else None
            runs[mode].append(run_generation(engine, prompts, batch, max_tokens, schema))
        print(f"  batch {batch}: {runs['unconstrained'][-1]['tok_s']} vs {runs['constrained'][-1]['tok_s']} tok/s",
              file=sys.stderr, flush=True)
    medians = {mode: statistics.median(r["tok_s"] for r in mode_runs) for mode, mode_runs in runs.items()}
    # Each pair ran back to back, so its ratio sees the least of the machine's drift: the headline.
    pairs = [c["tok_s"] / u["tok_s"] for u, c in zip(runs["unconstrained"], runs["constrained"], strict=True)]
    cpu_pairs = [c["tok_per_cpu_s"] / u["tok_per_cpu_s"]
                 for u, c in zip(runs["unconstrained"], runs["constrained"], strict=True)]
    # What the timed calls alone would cost: the ratio on a quiet machine if nothing else differed.
    overhead = statistics.median((r["apply_s"] + r["accept_token_s"]) / r["seconds"] for r in runs["constrained"])
    return {"batch": batch, "unconstrained_tok_s": medians["unconstrained"],
            "constrained_tok_s": medians["constrained"], "ratio": round(statistics.median(pairs), 3),
            "pair_ratios": [round(p, 3) for p in pairs], "cpu_ratio": round(statistics.median(cpu_pairs), 3),
            "cpu_pair_ratios": [round(p, 3) for p in cpu_pairs], "mask_overhead_share": round(overhead, 4), "runs": runs}


def time_compile(structured: Any, trials: int) -> dict:
    """Milliseconds to compile: the very first schema (loads xgrammar's tokenizer info), new schemas, cached ones."""
    def ms(spec: dict) -> float:
        start = time.perf_counter()
        structured.compile(spec)
        return (time.perf_counter() - start) * 1e3

    first = ms({"json": fresh_schema(-1)})
    new = [ms({"json": fresh_schema(i)}) for i in range(trials)]
    cached = [ms({"json": fresh_schema(i)}) for i in range(trials)]
    return {"first_schema_ms": round(first, 1), "new_schema_ms": round(statistics.median(new), 2),
            "cached_schema_ms": round(statistics.median(cached), 4), "trials": trials}


def time_mask(structured: Any, grammar: Any, token_ids: list[int], rows: int, vocab_size: int) -> dict:
    """Mean µs per step, replaying `token_ids` through `rows` matchers: StructuredOutputs.apply on [rows, V]
    fp32 logits, and apart: the bitmask fill (xgrammar), the control-byte ban, the masking, accept_token; and
    xgrammar's own CPU masking of the same bitmask, for comparison."""
    import xgrammar

    from pagedserve.backend.structured import mask_logits

    matchers = [structured.matcher(grammar) for _ in range(rows)]
    logits = torch.randn(rows, vocab_size)
    words = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)  # the ban's cost is its size
    all_rows = list(range(rows))
    parts = {"apply": 0.0, "fill": 0.0, "ban": 0.0, "mask": 0.0, "xgrammar_cpu_mask": 0.0, "accept": 0.0}
    for token in token_ids:
        t0 = time.perf_counter()
        structured.apply(logits, matchers)
        t1 = time.perf_counter()
        bitmask = xgrammar.allocate_token_bitmask(rows, vocab_size)
        for k, state in enumerate(matchers):
            state.matcher.fill_next_token_bitmask(bitmask, k)
        t2 = time.perf_counter()
        bitmask[all_rows] &= words
        t3 = time.perf_counter()
        mask_logits(logits, bitmask, all_rows)
        t4 = time.perf_counter()
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        t5 = time.perf_counter()
        for state in matchers:
            state.accept_token(token)
        t6 = time.perf_counter()
        for key, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            parts[key] += seconds
    return {"rows": rows, "steps": len(token_ids),
            **{f"{key}_us": round(total / len(token_ids) * 1e6, 1) for key, total in parts.items()}}


def print_tables(throughput: list[dict], compile_ms: dict, mask: list[dict]) -> None:
    """The throughput table, the compile times and the mask table."""
    header = f"{'batch':>5} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'ratio':>6} " \
             f"{'pair ratios':>20} {'CPU-time ratio':>15} {'apply+accept':>13} {'stopped':>8}"
    print(header)
    print("-" * len(header))
    for row in throughput:
        runs = row["runs"]["constrained"]
        stopped = f"{runs[0]['stopped_on_grammar_end']}/{runs[0]['num_requests']}"
        pairs = " ".join(f"{p:.3f}" for p in row["pair_ratios"])
        print(f"{row['batch']:>5} {row['unconstrained_tok_s']:>20.1f} {row['constrained_tok_s']:>18.1f} "
              f"{row['ratio']:>6.3f} {pairs:>20} {row['cpu_ratio']:>15.3f} {row['mask_overhead_share']:>12.1%} "
              f"{stopped:>8}")
    print(f"\ncompile: first schema {compile_ms['first_schema_ms']} ms (xgrammar's tokenizer info included), "
          f"new schema {compile_ms['new_schema_ms']} ms, cached {compile_ms['cached_schema_ms']} ms")
    print(f"\n{'rows':>4} {'apply µs':>9} {'fill':>8} {'ban':>7} {'mask':>8} {'accept':>7} {'xgrammar mask':>14}")
    for row in mask:
        print(f"{row['rows']:>4} {row['apply_us']:>9.1f} {row['fill_us']:>8.1f} {row['ban_us']:>7.1f} "
              f"{row['mask_us']:>8.1f} {row['accept_us']:>7.1f} {row['xgrammar_cpu_mask_us']:>14.1f}")


def plot(throughput: list[dict], path: Path) -> None:
    """Bars of unconstrained and constrained tokens/s per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = np.arange(len(throughput))
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for offset, key, label in ((-0.2, "unconstrained_tok_s", "unconstrained"),
                               (0.2, "constrained_tok_s", "JSON schema")):
        axes.bar(batches + offset, [row[key] for row in throughput], width=0.4, label=label)
    for x, row in zip(batches, throughput, strict=True):
        axes.annotate(f"{row['ratio']:.2f}×", (x + 0.2, row["constrained_tok_s"]), ha="center", va="bottom")
    axes.set_xticks(batches, [f"batch {row['batch']}" for row in throughput])
    axes.set_ylabel("output tokens/s")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    """Parse the arguments, run everything, write the JSON (and the PNG), print the tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="batches of B requests per run (4 at batch 1)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating unconstrained/constrained pairs")
    parser.add_argument("--compile-trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    # One thread: OpenMP threads spinning against another process on a shared 2-core machine distort it.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 round, 24 tokens")
    parser.add_argument("--plot", default=None, help="write a bar chart PNG here (e.g. docs/structured.png)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.max_tokens, args.compile_trials = 1, 1, 24, 5
    torch.set_num_threads(args.threads)
    record = run_all(args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    print_tables(record["throughput"], record["compile"], record["mask"])
    if args.plot:
        plot(record["throughput"], Path(args.plot))


def run_all(args: argparse.Namespace) -> dict:
    """Compile times first (the engine's compiler is still cold), then throughput, then the mask replay."""
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.model.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    # No prefix cache: both modes run the same prompts, and the second must not reuse the first's KV.
    engine = LLMEngine.from_pretrained(model, dtype=args.dtype, device="cpu", kv_cache_memory_bytes=1 << 30,
                                       max_num_seqs=max(BATCH_SIZES), max_model_len=4 * args.max_tokens,
                                       enable_prefix_caching=False)
    compile_ms = time_compile(engine.structured, args.compile_trials)
    prompts = make_prompts(max(BATCH_SIZES) * args.rounds, args.seed, engine.vocab_size, args.prompt_len)
    for schema in (None, SCHEMA):  # warm-up: the first forwards and the first masked step are slower
        run_generation(engine, prompts[:max(BATCH_SIZES)], max(BATCH_SIZES), 4, schema)
    throughput = []
    for batch in BATCH_SIZES:
        rounds = max(args.rounds, 4) if batch == 1 else args.rounds
        throughput.append(compare_throughput(engine, prompts[:batch * rounds], batch, args.max_tokens,
                                             args.repeats))
    grammar = engine.structured.compile({"json": SCHEMA})
    sample = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    replay = list(engine.generate([prompts[0]], sample)[0].outputs[0].token_ids)
    mask = [time_mask(engine.structured, grammar, replay, rows, engine.vocab_size) for rows in MASK_ROWS]
    return {
        "throughput": throughput, "compile": compile_ms, "mask": mask,
        "ratio_at_32": throughput[-1]["ratio"], "cpu_ratio_at_32": throughput[-1]["cpu_ratio"],
        "goal_ratio_at_32": 0.9,
        "schema": SCHEMA,
        "workload": f"prompts of {args.prompt_len} random mid-vocabulary ids (seed {args.seed}), temperature 1.0, "
                    f"seed i per request, max_tokens {args.max_tokens}, ignore_eos; batch B = B requests submitted "
                    f"together, {args.rounds} rounds (4 at batch 1); {args.repeats} alternating repeats, medians",
        "model": Path(model).name, "dtype": args.dtype,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, {args.threads} "
                   f"thread(s), torch {torch.__version__}",
        "command": "python bench/structured.py " + " ".join(sys.argv[1:]),
    }


if __name__ == "__main__":
    main()
