"""Tensor parallelism on GPUs, the `tp` part of bench/gpu_check.sh: one engine on one GPU against one split over
two (NCCL, rank r on cuda:r), the same random Llama in bf16, offline. Greedy tokens of a fixed prompt set under
TP 2 against TP 1 (the fraction of requests whose tokens are equal: bf16 all-reduces round differently, so a
near-tie may flip), and output tokens/s of all the prompts at once and of one stream.

    python bench/tp_gpu.py --out DIR             # needs 2 CUDA devices; DIR/tp_gpu.json
    python bench/tp_gpu.py --dry-run --out DIR   # anywhere: a tiny model on the CPU over gloo (the wiring only)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# A Llama of about 0.4B parameters: large enough that a step is GEMM-bound on an H100-class GPU.
GPU_SHAPE = {"hidden_size": 2048, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8, "intermediate_size": 5632,
             "max_position_embeddings": 4096}
DRY_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


def _generate(engine, prompts: list[list[int]], new_tokens: int) -> tuple[dict[str, list[int]], float]:
    """Every prompt at once, greedy: (tokens by request, seconds)."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    stamp = time.monotonic_ns()
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}-{stamp}", None, params, prompt_token_ids=ids)
    tokens, start = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                tokens[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - start


def measure(model: str, tp: int, dry: bool, prompts: list[list[int]], new_tokens: int) -> dict:
    """One engine of `tp` ranks: its greedy tokens and tokens/s, batched and one stream."""
    from pagedserve.backend.engine.llm_engine import LLMEngine

    device = "cpu" if dry else "cuda"
    engine = LLMEngine.from_pretrained(
        model, device=device, dtype="float32" if dry else "bfloat16", tensor_parallel_size=tp,
        enable_prefix_caching=False, max_num_seqs=len(prompts), max_model_len=1024 if not dry else 128,
        **({"cpu_threads": 1, "num_blocks": 64} if dry else {"kv_cache_memory_bytes": 8 << 30}))
    try:
        _generate(engine, prompts[:2], 4)  # warm-up: Triton compiles, NCCL connects
        tokens, seconds = _generate(engine, prompts, new_tokens)
        _, one_seconds = _generate(engine, prompts[:1], new_tokens)
    finally:
        engine.shutdown()
    produced = sum(map(len, tokens.values()))
    return {"tensor_parallel_size": tp, "tokens": tokens, "batched_tok_s": round(produced / seconds, 1),
            "one_stream_tok_s": round(new_tokens / one_seconds, 1), "seconds": round(seconds, 3)}


def main() -> None:
    """Make the model, run TP 1 then TP 2, write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    if not args.dry_run and torch.cuda.device_count() < 2:
        print(f"tp: skipped, {torch.cuda.device_count()} CUDA device(s); TP 2 needs 2", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tp_gpu.json").write_text(json.dumps({"skipped": "fewer than 2 CUDA devices"}) + "\n")
        return
    from pagedserve.testing import make_tiny_model

    num_prompts, new_tokens = (2, 3) if args.dry_run else (args.prompts, args.new_tokens)
    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(32 + i % 17)] for i in range(num_prompts)]
    with tempfile.TemporaryDirectory(prefix="pagedserve-tp-gpu-") as folder:
        shape = DRY_SHAPE if args.dry_run else GPU_SHAPE
        model = str(make_tiny_model(Path(folder) / "llama", "llama", dtype="float32" if args.dry_run else "bfloat16",
                                    **shape))
        one, two = (measure(model, tp, args.dry_run, prompts, new_tokens) for tp in (1, 2))
    equal = sum(one["tokens"][key] == two["tokens"].get(key) for key in one["tokens"]) / len(one["tokens"])
    record = {"model": f"random Llama {shape}, vocab 384", "device": "cpu (dry run)" if args.dry_run else
              torch.cuda.get_device_name(0), "prompts": num_prompts, "new_tokens": new_tokens,
              "tp1": {k: v for k, v in one.items() if k != "tokens"}, "tp2": {k: v for k, v in two.items() if k != "tokens"},
              "tp2_over_tp1_batched": round(two["batched_tok_s"] / one["batched_tok_s"], 3),
              "tp2_over_tp1_one_stream": round(two["one_stream_tok_s"] / one["one_stream_tok_s"], 3),
              "greedy_equal_fraction": round(equal, 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp_gpu.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'TP':>3} {'batched tok/s':>14} {'one stream tok/s':>17}")
    for row in (record["tp1"], record["tp2"]):
        print(f"{row['tensor_parallel_size']:>3} {row['batched_tok_s']:>14} {row['one_stream_tok_s']:>17}")
    print(f"TP 2 / TP 1: batched {record['tp2_over_tp1_batched']}, one stream {record['tp2_over_tp1_one_stream']}; "
          f"greedy tokens equal for {equal:.0%} of the requests")


if __name__ == "__main__":
    main()
