"""Where one engine step goes on the CPU path, by batch and context length.

Two kinds of step, each on the real LLMEngine (scheduler, model runner, sampler) with timers wrapped
around the model's kernels and linear layers:

- decode: B sequences whose contexts are L tokens each, one new token per sequence;
- prefill: a chunk of C new tokens against a cached prefix of L tokens (the prefix is computed by an
  earlier request with the same first L tokens and reused through prefix caching).

Buckets: decode attention (the native kernel), prefill attention (SDPA over the gathered context), the
paged-cache gather for prefill, KV write + rotary, GEMMs (every nn.Linear, lm_head included), norms,
activation, the logits' widening to fp32, sampler, the forward's own Python (module calls, kernel dispatch,
views, embedding), the runner's batch preparation, the scheduler (schedule + update), output processing
(sequences, stop checks, detokenizing) and the rest of the step.

    python bench/profile_step.py                        # bf16 and fp32, one thread
    python bench/profile_step.py --quick --dtypes bf16  # smaller shapes
    python bench/profile_step.py --workload short --dtypes bf16  # a throughput preset's whole run, by bucket
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "profile_step.json"
_clock = time.perf_counter  # --cpu-time: time.process_time (one thread on a shared, loaded box)
BUCKETS = ("decode_attn", "prefill_attn", "cache_gather", "rotary_kv_write", "gemm", "norm", "activation",
           "logits_cast", "sampler", "forward_py", "prepare", "schedule", "output", "other")


class StepTimer:
    """Accumulates wall time per bucket while `active`; nested buckets subtract from their parent."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False
        self.tokens = 0  # tokens the timed forwards computed
        self._stack: list[list] = []  # [bucket, start, child_time]

    def wrap(self, bucket: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            self._stack.append([bucket, _clock(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, start, child = self._stack.pop()
                elapsed = _clock() - start
                self.totals[name] += elapsed - child
                if self._stack:
                    self._stack[-1][2] += elapsed

        return timed

    def hook_module(self, bucket: str, module: torch.nn.Module) -> None:
        """Time a module's forward as `bucket` (a wrapped bound forward, so hooks stay untouched)."""
        module.forward = self.wrap(bucket, module.forward)

    @contextmanager
    def measure(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False


def instrument(engine, timer: StepTimer) -> None:
    """Wrap the CPU attention path, the kernels the model calls and every linear layer."""
    from pagedserve import kernels
    from pagedserve.kernels.attention import cpu

    cpu.decode_attention = timer.wrap("decode_attn", cpu.decode_attention)
    cpu._prefill_chunk = timer.wrap("prefill_attn", cpu._prefill_chunk)
    cpu._context = timer.wrap("cache_gather", cpu._context)
    kernels.rotary_embedding_and_cache = timer.wrap("rotary_kv_write", kernels.rotary_embedding_and_cache)
    kernels.rms_norm = timer.wrap("norm", kernels.rms_norm)
    kernels.silu_and_mul = timer.wrap("activation", kernels.silu_and_mul)
    model = engine.runner.model
    embed = model.embed

    def counted_embed(input_ids: torch.Tensor) -> torch.Tensor:
        timer.tokens += input_ids.numel() if timer.active else 0
        return embed(input_ids)

    model.embed = counted_embed
    for module in model.modules():
        # nn.Linear, the CPU path's PackedLinear (oneDNN prepacked) and quantized linears alike.
        if type(module).__name__.endswith("Linear"):
            timer.hook_module("gemm", module)
    # Calls look __call__ up on the class, so the sampler's class is patched (this process only).
    sampler_cls = type(engine.core.sampler)
    sampler_cls.__call__ = timer.wrap("sampler", sampler_cls.__call__)
    kernels.to_float32 = timer.wrap("logits_cast", kernels.to_float32)
    # The Python of the forward itself: what the model's forward and lm_head take beyond the timed kernels.
    model.forward = timer.wrap("forward_py", model.forward)
    model.compute_logits = timer.wrap("forward_py", model.compute_logits)
    engine.runner._prepare = timer.wrap("prepare", engine.runner._prepare)
    sched = engine.scheduler
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_from_output = timer.wrap("schedule", sched.update_from_output)
    for name in ("process", "collect", "claim_rows"):  # sequences, stop checks, detokenizing, RequestOutputs
        setattr(engine.output, name, timer.wrap("output", getattr(engine.output, name)))


def _prompt(rng: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(1000, vocab - 1000, (n,), generator=rng).tolist()


def _time_steps(engine, timer: StepTimer, steps: int) -> dict:
    """Run `steps` engine steps under the timer; per-step milliseconds by bucket."""
    timer.totals.clear()
    start = _clock()
    with timer.measure():
        for _ in range(steps):
            engine.step()
    total = _clock() - start
    out = {b: timer.totals.get(b, 0.0) for b in BUCKETS if b != "other"}
    out["other"] = total - sum(out.values())
    return {"total_ms": round(1000 * total / steps, 3), **{b: round(1000 * v / steps, 3) for b, v in out.items()}}


def profile_decode(engine, timer: StepTimer, batch: int, context: int, steps: int, vocab: int) -> dict:
    """B sequences with L-token prompts, prefilled first; then `steps` decode steps timed."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    rng = torch.Generator().manual_seed(batch * 100003 + context)
    # Enough tokens that no sequence finishes while the others prefill (each prefill step also decodes the
    # sequences already prefilled): all B decode together in the timed steps, which `batch` in the row checks.
    prefill_steps = batch * context // engine.scheduler.config.max_num_batched_tokens + batch + 2
    params = SamplingParams(temperature=1.0, max_tokens=steps + 2 + prefill_steps, ignore_eos=True)
    ids = [f"d{batch}-{context}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, None, params, prompt_token_ids=_prompt(rng, context, vocab))
    # Prefill (and the first sampled token) outside the timer.
    sched = engine.scheduler
    while len(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    engine.step()
    decoding = len(sched.running)
    row = _time_steps(engine, timer, steps)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {"kind": "decode", "batch": batch, "decoding": decoding, "context": context, **row}


def profile_prefill(engine, timer: StepTimer, chunk: int, context: int, vocab: int) -> dict:
    """A C-token chunk after an L-token prefix that an earlier request left in the prefix cache."""
    from pagedserve.backend.core.sampling_params import SamplingParams

    rng = torch.Generator().manual_seed(chunk * 100003 + context + 1)
    prefix = _prompt(rng, context, vocab)
    one = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    if context:
        engine.add_request(f"p{chunk}-{context}-prefix", None, one, prompt_token_ids=prefix)
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request(f"p{chunk}-{context}", None, one, prompt_token_ids=prefix + _prompt(rng, chunk, vocab))
    timer.tokens = 0
    row = _time_steps(engine, timer, 1)
    tokens = timer.tokens
    while engine.has_unfinished_requests():
        engine.step()
    return {"kind": "prefill", "chunk": chunk, "context": context, "computed_tokens": tokens, **row}


def profile_workload(engine, timer: StepTimer, name: str, vocab: int, quick: bool) -> dict:
    """bench/throughput.py's preset run through engine.generate under the timer: time by bucket over the
    whole run, as its own batches and chunks make it (per step: the mean over its steps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import PRESETS, QUICK, from_preset

    from pagedserve.backend.core.sampling_params import SamplingParams

    workload = from_preset(QUICK if quick else PRESETS[name], vocab)
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    engine.generate([workload.prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    timer.totals.clear()
    start = _clock()
    with timer.measure():
        engine.generate(workload.prompts, params)
    total = _clock() - start
    engine.step = step
    out = {b: timer.totals.get(b, 0.0) for b in BUCKETS if b != "other"}
    out["other"] = total - sum(out.values())
    return {"kind": "workload", "workload": "quick" if quick else name, "steps": steps,
            "tok_s": round(workload.num_output_tokens / total, 2), "seconds": round(total, 2),
            "total_ms": round(1000 * total / steps, 3), **{b: round(1000 * v / steps, 3) for b, v in out.items()}}


def _shape(r: dict) -> str:
    if r["kind"] == "decode":  # B=16 (3): only 3 of the 16 were still decoding (the cache did not hold them all)
        shown = "" if r.get("decoding", r["batch"]) == r["batch"] else f" ({r['decoding']})"
        return f"decode B={r['batch']}{shown} L={r['context']}"
    if r["kind"] == "prefill":
        return f"prefill C={r['chunk']} L={r['context']}"
    return f"{r['workload']} {r['tok_s']} tok/s"


def print_table(rows: list[dict]) -> None:
    head = f"{'dtype':<5} {'step':<22} {'total ms':>9} " + " ".join(f"{b[:12]:>12}" for b in BUCKETS)
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = _shape(r)
        cells = " ".join(f"{100 * r[b] / r['total_ms']:>11.1f}%" for b in BUCKETS)
        print(f"{r['dtype']:<5} {shape:<22} {r['total_ms']:>9.2f} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk C")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per shape")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, contexts 256 and 1024")
    parser.add_argument("--kinds", default="decode,prefill", help="comma list of decode, prefill")
    parser.add_argument("--single-pass-prefill", action="store_true",
                        help="A/B: a chunk after a prefix as one masked SDPA (the path before the two-pass merge)")
    parser.add_argument("--sdpa-prefill", action="store_true",
                        help="A/B: prefill chunks on SDPA, not the native kernel over the block table (bf16, AMX)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in this process's CPU time (with --threads 1: steadier on a loaded machine)")
    parser.add_argument("--workload", default=None,
                        help="profile bench/throughput.py's preset run instead (with --quick: its --quick run)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.single_pass_prefill:
        from pagedserve.kernels.attention import cpu

        cpu._flash_with_lse = None
    if args.sdpa_prefill:
        os.environ["PAGEDSERVE_PREFILL_KERNEL"] = "0"
    if args.cpu_time:
        global _clock
        _clock = time.process_time
    if args.quick and not args.workload:
        args.batches, args.contexts, args.steps = "1,4", "256,1024", 4

    from transformers import AutoConfig

    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.model.default_model import ensure_default_model

    torch.set_num_threads(args.threads)
    model = args.model or ensure_default_model()
    vocab = AutoConfig.from_pretrained(model).vocab_size
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for name in args.dtypes.split(","):
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[name]
        engine = LLMEngine.from_pretrained(model, dtype=dtype, device="cpu", kv_cache_memory_bytes=2 << 30,
                                           max_num_seqs=256, max_num_batched_tokens=max(2048, args.chunk),
                                           max_model_len=8192, cpu_threads=args.threads)
        timer = StepTimer()
        instrument(engine, timer)
        if args.workload:
            rows.append({"dtype": name, **profile_workload(engine, timer, args.workload, vocab, args.quick)})
            engine.shutdown()
            continue
        profile_decode(engine, timer, 1, 64, 2, vocab)  # warm-up
        kinds = args.kinds.split(",")
        for context in contexts if "decode" in kinds else []:
            for batch in batches:
                rows.append({"dtype": name, **profile_decode(engine, timer, batch, context, args.steps, vocab)})
                print(rows[-1], file=sys.stderr, flush=True)
        for context in [0, *contexts] if "prefill" in kinds else []:
            rows.append({"dtype": name, **profile_prefill(engine, timer, args.chunk, context, vocab)})
            print(rows[-1], file=sys.stderr, flush=True)
        engine.shutdown()
    print_table(rows)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "buckets": list(BUCKETS), "model": Path(model).name,
        "machine": f"{platform.machine()}, {args.threads} thread(s), torch {torch.__version__}",
        "command": "python bench/profile_step.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
