"""N-gram speculative decoding: output tokens/s and time per output token with and without it, side by side,
on a repetitive workload (repeat or edit a given passage) and a non-repetitive one (open questions), at
concurrency 1, 4 and 16, and the drafts' acceptance rate per position.

Greedy chat prompts on the default model, offline: `c` requests in flight, the next added as one ends, until
`requests` have run; prefix caching off, so a repeated prompt costs the same every time. The plain and the
speculative engines (always on, and off from `--disable-by-batch-size` running requests) run each cell back
to back, the order reversed every other cell; how many outputs differ from the plain engine's is counted.
TPOT is (last token time - first token time) / (tokens - 1) per request, averaged; the CPU-time speedup
divides by the process's CPU time instead of wall time (one torch thread), steadier when other jobs share
the cores.

    nice python bench/speculative.py            # about 5 minutes on 2 shared cores
    nice python bench/speculative.py --quick    # concurrency 1 and 4, 24 tokens
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "speculative.json"
CONCURRENCY = (1, 4, 16)
PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt "
           "wind. Every evening the keeper climbed the spiral stairs, trimmed the wick and lit the lamp, so "
           "that ships passing in the dark would know where the rocks began.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total += item.price "
        "* item.quantity\n    return total * (1 + tax_rate)\n")
WORKLOADS = {
    "repetitive": [
        f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
        f"Rewrite this function with the variable `total` renamed to `subtotal`; change nothing else:\n\n{CODE}",
        f"Copy this text and then continue it with one more sentence:\n\n{PASSAGE}",
        f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    ],
    "non-repetitive": [
        "Give three tips for learning a new language.",
        "Why is the sky blue? Explain briefly.",
        "Write a short poem about autumn leaves.",
        "What are the benefits of regular exercise?",
    ],
}


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the chat template renders one user turn, with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def run_cell(engine: Any, prompts: list[list[int]], concurrency: int, num_requests: int, max_tokens: int) -> dict:
    """`num_requests` greedy requests, `concurrency` in flight; tokens/s, TPOT, outputs and spec counters."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.get_stats()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    queued, in_flight = 0, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while len(outputs) < num_requests:
        while in_flight < concurrency and queued < num_requests:
            engine.add_request(f"q{queued}", None, params, prompt_token_ids=prompts[queued % len(prompts)])
            queued, in_flight = queued + 1, in_flight + 1
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                in_flight -= 1
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(t) for t in outputs.values())
    tpot = statistics.mean((last[r] - first[r]) / (len(t) - 1) for r, t in outputs.items() if len(t) > 1)
    after = engine.get_stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    per_pos = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                     before.spec_decode_num_accepted_tokens_per_pos or
                                     [0] * len(after.spec_decode_num_accepted_tokens_per_pos), strict=True)]
    return {
        "seconds": round(seconds, 3), "output_tokens": tokens, "tok_s": round(tokens / seconds, 2),
        # With one thread, CPU time leaves out the time other jobs held the core: steadier on a shared machine.
        "cpu_seconds": round(cpu_seconds, 3), "tok_per_cpu_s": round(tokens / cpu_seconds, 2),
        "tpot_ms": round(tpot * 1e3, 2), "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
        "acceptance_per_pos": [round(n / drafts, 3) if drafts else None for n in per_pos],
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "outputs": [outputs[f"q{i}"] for i in range(num_requests)],
    }


def compare(engines: dict[str, Any], prompts: list[list[int]], concurrency: int, num_requests: int,
            max_tokens: int, flip: bool) -> dict:
    """One cell on every engine back to back (the order reversed when `flip`); outputs compared with plain's."""
    order = list(reversed(engines)) if flip else list(engines)
    runs = {name: run_cell(engines[name], prompts, concurrency, num_requests, max_tokens) for name in order}
    outputs = {name: run.pop("outputs") for name, run in runs.items()}
    differ = {name: sum(a != b for a, b in zip(out, outputs["plain"], strict=True))
              for name, out in outputs.items() if name != "plain"}
    return {"concurrency": concurrency, "requests": num_requests, "outputs_differing": differ,
            **{f"speedup_{name}": round(runs[name]["tok_s"] / runs["plain"]["tok_s"], 3) for name in differ},
            **{f"cpu_speedup_{name}": round(runs[name]["tok_per_cpu_s"] / runs["plain"]["tok_per_cpu_s"], 3)
               for name in differ},
            **{name: runs[name] for name in engines}}


def print_table(cells: list[dict]) -> None:
    """One row per workload, concurrency and speculative engine, against the plain engine's figures."""
    header = (f"{'workload':>15} {'c':>3} {'engine':>18} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} "
              f"{'CPU-time':>9} {'plain TPOT ms':>14} {'spec TPOT ms':>13} {'accept':>7} {'differ':>7}  per position")
    print(header)
    print("-" * len(header))
    for cell in cells:
        plain = cell["plain"]
        for name, differ in cell["outputs_differing"].items():
            spec = cell[name]
            per_pos = " ".join("-" if a is None else f"{a:.2f}" for a in spec["acceptance_per_pos"])
            rate = "-" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.2f}"
            print(f"{cell['workload']:>15} {cell['concurrency']:>3} {name:>18} {plain['tok_s']:>12.1f} "
                  f"{spec['tok_s']:>11.1f} {cell['speedup_' + name]:>7.2f}x {cell['cpu_speedup_' + name]:>8.2f}x "
                  f"{plain['tpot_ms']:>14.1f} "
                  f"{spec['tpot_ms']:>13.1f} {rate:>7} {differ:>3}/{cell['requests']:<3}  {per_pos}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", help="float32: outputs comparable exactly (bf16 rounds apart)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=4,
                        help="a third engine with this disable_by_batch_size (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 24 tokens")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    concurrency = CONCURRENCY[:2] if args.quick else CONCURRENCY
    max_tokens = 24 if args.quick else args.max_tokens
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.model.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    settings = {"dtype": args.dtype, "device": "cpu", "kv_cache_memory_bytes": 1 << 28, "max_num_seqs": 16,
                "max_model_len": 512, "enable_prefix_caching": False}
    engines = {"plain": LLMEngine.from_pretrained(model, **settings),
               "speculative": LLMEngine.from_pretrained(model, **settings, speculative_config=spec)}
    if args.disable_by_batch_size:
        engines[f"off_from_{args.disable_by_batch_size}"] = LLMEngine.from_pretrained(
            model, **settings, speculative_config={**spec, "disable_by_batch_size": args.disable_by_batch_size})
    tokenizer = engines["plain"].tokenizer
    cells = []
    for name, texts in WORKLOADS.items():
        prompts = [chat_ids(tokenizer, text) for text in texts]
        for engine in engines.values():  # warm-up
            run_cell(engine, prompts[:1], 1, 1, 4)
        for i, c in enumerate(concurrency):
            cell = compare(engines, prompts, c, max(c, len(prompts)), max_tokens, flip=i % 2 == 1)
            cells.append({"workload": name, **cell})
            print(f"  {name} c={c}: " + ", ".join(f"{e} {cell[e]['tok_s']}" for e in engines) + " tok/s",
                  file=sys.stderr, flush=True)
    record = {
        "cells": cells, "speculative_config": spec, "model": Path(model).name, "dtype": args.dtype,
        "max_tokens": max_tokens, "threads": args.threads, "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "workload": "greedy chat prompts, ignore_eos, c in flight (the next added as one ends), max(c, 4) requests "
                    "per cell, prefix caching off; the engines back to back, order reversed every other cell",
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    print_table(cells)


if __name__ == "__main__":
    main()
