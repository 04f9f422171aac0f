"""Quantized weights on the default model (SmolLM2-135M-Instruct), one CPU thread, side by side in one run:
fp32, bf16, int8 and int4 quantized at load, and the Q4_1 GGUF served natively (the quantized ones with fp32
and with bf16 activations). For each: weight bytes, greedy
decode output tokens/s at concurrency 1, 8 and 32, and the mean |delta logprob| against fp32 on a fixed text.

    python bench/quantized.py            # 128 new tokens per stream
    python bench/quantized.py --quick    # 32 new tokens, a smoke run
    python bench/quantized.py --llama-cpp --only gguf_q4_1,int4_bf16   # beside llama.cpp on the same GGUF
    python bench/quantized.py --gguf Q4_K_M --only gguf_q4_k_m_bf16 --llama-cpp --threads 2 --concurrency 1

`--llama-cpp` adds llama.cpp on the same file and workload (bench/llamacpp_peer.py, built once into the cache):
its Python binding for one stream (`--peer-one-stream server`: its `llama-server --parallel 1` instead), its own
`llama-server --parallel N` for N streams. `--gguf Q4_K_M` (or Q6_K, ...) benchmarks a file llama.cpp's
`llama-quantize --allow-requantize` made from the default model's Q4_1 file, on both sides. Where llama-server
dies with SIGILL at load (its weight repacking on a VM without AMX permission), run with LLAMA_ARG_REPACK=false.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

RESULTS = Path(__file__).resolve().parent / "results" / "quantized.json"
TEXT = ("The capital of France is Paris. It lies on the Seine, and its museums hold paintings from every "
        "century. Once upon a time there was a small model that learned to count: one, two, three, four.")
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
           "List five facts about the Moon.", "What is the capital of France?"]


def gguf_path(kind: str) -> str:
    """The default model's GGUF of `kind`: the wheel's own Q4_1 file, else one llama-quantize made from it."""
    from pagedserve.backend.model.default_model import find_gguf

    if kind.upper() == "Q4_1":
        return str(find_gguf())
    import llamacpp_peer

    path, why = llamacpp_peer.quantized_gguf(kind.upper())
    if path is None:
        raise SystemExit(f"no {kind} file: {why}")
    return str(path)


def variants(gguf_kinds: list[str]) -> dict[str, tuple[str, dict]]:
    """name -> (model path, from_pretrained settings)."""
    from pagedserve.backend.model.default_model import ensure_default_model, find_gguf

    folder = ensure_default_model()
    extra = {}
    for kind in (k for k in gguf_kinds if k.upper() != "Q4_1"):
        path = gguf_path(kind)
        extra[f"gguf_{kind.lower()}"] = (path, {"dtype": "float32"})
        extra[f"gguf_{kind.lower()}_bf16"] = (path, {"dtype": "bfloat16"})
    return extra | {
        "fp32": (folder, {"dtype": "float32"}),
        "bf16": (folder, {"dtype": "bfloat16"}),
        "int8": (folder, {"dtype": "float32", "quantization": "int8"}),
        "int4": (folder, {"dtype": "float32", "quantization": "int4"}),
        "gguf_q4_1": (str(find_gguf()), {"dtype": "float32"}),
        # Activations in bf16 too: torch's packed kernels compute in bf16 anyway, and attention and norms
        # run faster in bf16 on a CPU with AVX-512 BF16.
        "int8_bf16": (folder, {"dtype": "bfloat16", "quantization": "int8"}),
        "int4_bf16": (folder, {"dtype": "bfloat16", "quantization": "int4"}),
        "gguf_q4_1_bf16": (str(find_gguf()), {"dtype": "bfloat16"}),
    }


def prompt_ids(tokenizer, concurrency: int) -> list[list[int]]:
    """The chat-templated prompts of `concurrency` streams, as token ids."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                             add_generation_prompt=True, tokenize=True)
               for i in range(concurrency)]
    return [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]


def decode_tok_s(engine, concurrency: int, new_tokens: int, cpu_time: bool = False) -> float:
    """Output tokens/s of `concurrency` greedy streams of `new_tokens` each, all submitted at once; with `cpu_time`,
    per second of this process's CPU time (a shared machine's other jobs then cost less of the figure)."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    prompts = prompt_ids(engine.tokenizer, concurrency)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    clock = time.process_time if cpu_time else time.perf_counter
    start = clock()
    outputs = engine.generate(prompts, params)
    seconds = clock() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def text_logprobs(engine) -> list[float]:
    """Each token of TEXT's logprob given the ones before it."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    ids = engine.tokenizer(TEXT)["input_ids"]
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return [row[token] for row, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]


def run_variant(path: str, settings: dict, new_tokens: int, concurrencies: list[int], threads: int,
                cpu_time: bool = False) -> dict:
    """Load one variant and measure it."""
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.model.quantized import weight_bytes

    start = time.perf_counter()
    engine = LLMEngine.from_pretrained(path, device="cpu", cpu_threads=threads, kv_cache_memory_bytes=256 << 20,
                                       **settings)
    row = {"load_s": round(time.perf_counter() - start, 1),
           "weight_MiB": round(weight_bytes(engine.runner.model) / 2**20, 1)}
    row["tok_s"] = {str(c): round(decode_tok_s(engine, c, new_tokens, cpu_time), 1) for c in concurrencies}
    row["text_logprobs"] = text_logprobs(engine)
    return row


def run_llama_cpp(gguf: str, new_tokens: int, concurrencies: list[int], threads: int, one_stream: str,
                  cpu_time: bool = False) -> dict:
    """llama.cpp on `gguf`: the binding (or llama-server --parallel 1) for one stream, llama-server --parallel N
    for N > 1."""
    import tempfile

    import llamacpp_peer

    from pagedserve.backend.model.loader import load_tokenizer
    from pagedserve.client.launcher import free_loopback_ports

    tokenizer = load_tokenizer(gguf)
    row: dict = {"tok_s": {}, "notes": [], "one_stream": one_stream}
    if 1 in concurrencies and one_stream == "binding":
        python, why = llamacpp_peer.binding_python()
        if python is not None:
            row["tok_s"]["1"] = round(llamacpp_peer.binding_tok_s(python, gguf, prompt_ids(tokenizer, 1), new_tokens,
                                                                  threads, Path(tempfile.mkdtemp())), 1)
        else:
            row["notes"].append(why)
    binary, why = llamacpp_peer.server_binary()
    if binary is None:
        row["notes"].append(why)
    served = [c for c in concurrencies if c > 1 or (c == 1 and one_stream == "server")]
    for c in (c for c in served if binary is not None):
        row["tok_s"][str(c)] = round(llamacpp_peer.server_tok_s(binary, gguf, prompt_ids(tokenizer, c), new_tokens,
                                                                threads, free_loopback_ports(1)[0], cpu_time), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 new tokens per stream")
    parser.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    parser.add_argument("--gguf", default="Q4_1", help="comma-separated GGUF kinds: Q4_1 (the wheel's), Q4_K_M, Q6_K..")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of both engines")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same GGUF and workload")
    parser.add_argument("--peer-one-stream", choices=("binding", "server"), default="binding",
                        help="llama.cpp's one stream through its Python binding or llama-server --parallel 1")
    parser.add_argument("--cpu-time", action="store_true",
                        help="tok/s per CPU second of each engine's process (the binding is then not used)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    new_tokens = 32 if args.quick else 128
    kinds = args.gguf.split(",")
    chosen = variants(kinds)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    report = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
              "new_tokens": new_tokens, "greedy": True, "clock": "cpu" if args.cpu_time else "wall", "variants": {}}
    for name, (path, settings) in chosen.items():
        row = run_variant(path, settings, new_tokens, args.concurrency, args.threads, args.cpu_time)
        report["variants"][name] = row
        print(f"{name}: {row['weight_MiB']} MiB, tok/s {row['tok_s']}", flush=True)
    if args.llama_cpp:
        for kind in kinds:
            one_stream = "server" if args.cpu_time else args.peer_one_stream
            peer = run_llama_cpp(gguf_path(kind), new_tokens, args.concurrency, args.threads, one_stream, args.cpu_time)
            report[f"llama_cpp_{kind.lower()}"] = peer
            print(f"llama.cpp {kind}: tok/s {peer['tok_s']} {peer['notes']}", flush=True)
    base = report["variants"].get("fp32", {}).get("text_logprobs")
    for row in report["variants"].values():
        lps = row.pop("text_logprobs")
        if base:
            row["mean_abs_dlogprob_vs_fp32"] = round(sum(abs(a - b) for a, b in zip(lps, base, strict=True))
                                                     / len(base), 4)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["variants"], indent=2))


if __name__ == "__main__":
    main()
