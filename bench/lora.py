"""Multi-LoRA: offline tokens/s with no adapter, one adapter, and 4 adapters mixed uniformly (request i runs adapter
i mod 4), at concurrency 8 and 32, against the base-only run; and the time to load an adapter.

The engine runs in-process (LLMEngine, CPU, one thread) on a random Llama of 8 layers, hidden 512 (23.6M
parameters, fp32), with PEFT adapters of rank 16 on all seven projections (pagedserve.testing.make_lora_adapter).
One seeded closed-loop workload: C requests in flight, a new one added as each ends, random prompt ids, greedy,
max_tokens fixed, ignore_eos, no prefix cache. The modes alternate (ABC then CBA) `repeats` times; the ratio is
the median of each repeat's ratio to its own base run. "base, LoRA off" is the same base workload on an engine
built without LoRA: what enabling it costs a step with no adapter rows.

    python bench/lora.py           # 3 repeats (about 6 minutes on 2 shared cores)
    python bench/lora.py --quick   # 1 repeat, shorter outputs (about a minute)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "lora.json"
CONCURRENCIES = (8, 32)
NUM_ADAPTERS = 4
MODES = ("base", "one adapter", "4 adapters mixed", "base, LoRA off")
MODEL_SHAPE = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408}
GOAL_RATIO = 0.8  # 4 mixed adapters at rank 16 against base-only, issue 20
_request_ids = itertools.count()


def make_model_and_adapters(folder: Path, rank: int) -> tuple[Path, list[Path]]:
    """The random base model and NUM_ADAPTERS + 1 adapters (the last one only for the load timing)."""
    from pagedserve.testing import make_lora_adapter, make_tiny_model

    base = make_tiny_model(folder / "base", "llama", max_position_embeddings=1024, **MODEL_SHAPE)
    adapters = [make_lora_adapter(base, folder / f"adapter{i}", rank=rank, alpha=2 * rank, seed=i + 1)
                for i in range(NUM_ADAPTERS + 1)]
    return base, adapters


def adapter_names(mode: str, count: int) -> list[str | None]:
    """Each request's adapter in `mode`."""
    if mode == "one adapter":
        return ["a0"] * count
    if mode == "4 adapters mixed":
        return [f"a{i % NUM_ADAPTERS}" for i in range(count)]
    return [None] * count


def run_closed_loop(engine: Any, prompts: list[list[int]], names: list[str | None], concurrency: int,
                    max_tokens: int) -> dict:
    """Keep `concurrency` requests in flight until all of `prompts` ran; tokens/s of the whole run."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    waiting = deque(range(len(prompts)))
    in_flight, tokens = 0, 0

    def submit() -> None:
        i = waiting.popleft()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=names[i])
        engine.add_request(f"bench-{next(_request_ids)}", None, params, prompt_token_ids=prompts[i])

    start, cpu_start = time.perf_counter(), time.process_time()
    while waiting or in_flight:
        while waiting and in_flight < concurrency:
            submit()
            in_flight += 1
        for output in engine.step():
            if output.finished:
                in_flight -= 1
                tokens += len(output.outputs[0].token_ids)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "tok_s": round(tokens / seconds, 2),
            # With one thread, CPU time leaves out the time other jobs held the core: steadier on a shared machine.
            "cpu_seconds": round(cpu_seconds, 3), "tok_per_cpu_s": round(tokens / cpu_seconds, 2)}


def compare_modes(engines: dict[str, Any], prompts: list[list[int]], concurrency: int, max_tokens: int,
                  repeats: int) -> dict:
    """Every mode `repeats` times in alternating order; medians, and each mode's median ratio to base."""
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        # ABC then CBA: a drift of the machine's load over the run falls on every mode alike.
        for mode in (MODES if repeat % 2 == 0 else tuple(reversed(MODES))):
            engine = engines["off" if mode == "base, LoRA off" else "on"]
            runs[mode].append(run_closed_loop(engine, prompts, adapter_names(mode, len(prompts)), concurrency,
                                              max_tokens))
        print(f"  concurrency {concurrency}: " + ", ".join(f"{m} {runs[m][-1]['tok_s']}" for m in MODES) + " tok/s",
              file=sys.stderr, flush=True)

    def ratio(mode: str, key: str) -> float:
        return round(statistics.median(r[key] / b[key] for r, b in zip(runs[mode], runs["base"], strict=True)), 3)

    return {"concurrency": concurrency,
            **{f"{mode} tok/s": statistics.median(r["tok_s"] for r in runs[mode]) for mode in MODES},
            **{f"{mode} ratio": ratio(mode, "tok_s") for mode in MODES[1:]},
            **{f"{mode} cpu ratio": ratio(mode, "tok_per_cpu_s") for mode in MODES[1:]},
            "runs": runs}


def time_adapter_load(engine: Any, folder: Path, trials: int) -> dict:
    """Milliseconds for add_lora (read, check, fold, pin a rank-16 adapter) and remove_lora, medians."""
    loads, removes = [], []
    for trial in range(trials):
        start = time.perf_counter()
        engine.add_lora(f"probe{trial}", str(folder))
        middle = time.perf_counter()
        engine.remove_lora(f"probe{trial}")
        loads.append((middle - start) * 1e3)
        removes.append((time.perf_counter() - middle) * 1e3)
    return {"first_load_ms": round(loads[0], 2), "load_ms": round(statistics.median(loads[1:] or loads), 2),
            "unload_ms": round(statistics.median(removes), 3), "trials": trials}


def print_table(rows: list[dict], load: dict) -> None:
    """One line per concurrency: each mode's tokens/s and its ratio to base, by wall time and by CPU time."""
    header = f"{'C':>3} {'base tok/s':>11}" + "".join(f" {mode:>17} {'ratio':>6} {'CPU':>6}" for mode in MODES[1:])
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['concurrency']:>3} {row['base tok/s']:>11.1f}" + "".join(
            f" {row[mode + ' tok/s']:>17.1f} {row[mode + ' ratio']:>6.3f} {row[mode + ' cpu ratio']:>6.3f}"
            for mode in MODES[1:]))
    print(f"\nadapter load: first {load['first_load_ms']} ms, then {load['load_ms']} ms (median of "
          f"{load['trials'] - 1}); unload {load['unload_ms']} ms")


def run_all(args: argparse.Namespace, folder: Path) -> dict:
    """Build the model, adapters and both engines; warm up; time the loads, then every mode."""
    from pagedserve.backend.engine.llm_engine import LLMEngine

    base, adapters = make_model_and_adapters(folder, args.rank)
    common = {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 1 << 30, "enable_prefix_caching": False,
              "max_num_seqs": max(CONCURRENCIES), "max_model_len": args.prompt_len + args.max_tokens}
    engines = {
        "on": LLMEngine.from_pretrained(str(base), enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank,
                                        max_cpu_loras=NUM_ADAPTERS + 1, **common,
                                        lora_modules={f"a{i}": str(adapters[i]) for i in range(NUM_ADAPTERS)}),
        "off": LLMEngine.from_pretrained(str(base), **common),
    }
    rng = np.random.default_rng(args.seed)
    num_requests = max(CONCURRENCIES) * args.rounds
    prompts = [rng.integers(10, 380, args.prompt_len).tolist() for _ in range(num_requests)]
    for mode in MODES:  # warm-up: the first forwards (and each adapter's first step) are slower
        engine = engines["off" if mode == "base, LoRA off" else "on"]
        run_closed_loop(engine, prompts[:max(CONCURRENCIES)], adapter_names(mode, max(CONCURRENCIES)),
                        max(CONCURRENCIES), 4)
    load = time_adapter_load(engines["on"], adapters[-1], args.load_trials)
    rows = [compare_modes(engines, prompts[:concurrency * args.rounds], concurrency, args.max_tokens,
                          args.repeats) for concurrency in CONCURRENCIES]
    mixed = {row["concurrency"]: row["4 adapters mixed ratio"] for row in rows}
    return {
        "throughput": rows, "adapter_load": load,
        **{f"mixed_ratio_at_{c}": ratio for c, ratio in mixed.items()},
        "mixed_cpu_ratio_at_32": rows[-1]["4 adapters mixed cpu ratio"],
        "goal_ratio": GOAL_RATIO, "meets_goal": all(ratio >= GOAL_RATIO for ratio in mixed.values()),
        "model": f"random Llama {MODEL_SHAPE}, vocab 384, fp32", "adapters": f"{NUM_ADAPTERS} of rank {args.rank} "
                 "(alpha 2r) on q/k/v/o/gate/up/down, random B", "max_loras": NUM_ADAPTERS,
        "workload": f"closed loop at concurrency C, C * {args.rounds} requests, prompts of {args.prompt_len} random "
                    f"ids (seed {args.seed}), greedy, max_tokens {args.max_tokens}, ignore_eos, no prefix cache; "
                    f"{args.repeats} alternating repeats, medians",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, {args.threads} "
                   f"thread(s), torch {torch.__version__}",
        "command": "python bench/lora.py " + " ".join(sys.argv[1:]),
    }


def main() -> None:
    """Parse the arguments, run everything, write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per run: C * rounds")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of every mode")
    parser.add_argument("--load-trials", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    # One thread: OpenMP threads spinning against another process on a shared 2-core machine distort it.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 round, 24 tokens")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.max_tokens, args.load_trials = 1, 1, 24, 3
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-lora-") as folder:
        record = run_all(args, Path(folder))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    print_table(record["throughput"], record["adapter_load"])


if __name__ == "__main__":
    main()
