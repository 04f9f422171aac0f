"""Serving through Triton vs the in-process engine, on one seeded workload.

`python bench/serving.py` starts tritonserver (the pagedserve repository) and drives the `llm` model
with tritonclient gRPC streaming at concurrency 1, 8 and 32 (closed loop: each of C clients, one gRPC
stream each, sends its next request when the previous one ends), and runs the same requests on an
in-process `LLMEngine` with the same concurrency, the two interleaved level by level; at concurrency 1
they alternate request by request, so both paths see the same machine load and the TTFT difference can
be paired per prompt. It reports TTFT, inter-token latency and end-to-end latency (p50/p90/p99) and
output tokens/s for both, the throughput ratio and the TTFT the Triton path adds, and writes
bench/results/serving.json. `--tiny` uses a tiny random model (a smoke run of the wiring).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over lazy dog paged attention stores keys and values in blocks "
         "a scheduler runs one token budget per step while requests arrive and leave").split()


@dataclass
class Timing:
    """One request's client-side clock: send time, the arrival of each response, and tokens per response."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)


def make_workload(num_requests: int, seed: int, min_words: int, max_words: int) -> list[str]:
    """Seeded prompts of random length built from a fixed word list."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(num_requests)]


def summarize(timings: list[Timing], wall_s: float) -> dict:
    """Latency percentiles in milliseconds and output tokens/s over the level's wall time."""
    ttft = [(t.arrivals[0] - t.sent) * 1e3 for t in timings if t.arrivals]
    e2e = [(t.arrivals[-1] - t.sent) * 1e3 for t in timings if t.arrivals]
    itl = []
    for t in timings:
        for prev, cur, n in zip(t.arrivals, t.arrivals[1:], t.tokens[1:], strict=False):
            itl.extend([(cur - prev) * 1e3 / max(n, 1)] * max(n, 1))

    def pct(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p90": None, "p99": None}
        return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)}

    tokens = sum(t.num_tokens for t in timings)
    return {"ttft_ms": pct(ttft), "itl_ms": pct(itl), "e2e_ms": pct(e2e), "output_tokens": tokens,
            "wall_s": round(wall_s, 3), "tok_s": round(tokens / wall_s, 2)}


def _triton_inputs(prompt: str, sampling: dict) -> list:
    import tritonclient.grpc.aio as grpcclient

    def tensor(name: str, array: np.ndarray, dtype: str):
        inp = grpcclient.InferInput(name, list(array.shape), dtype)
        inp.set_data_from_numpy(array)
        return inp

    return [
        tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("exclude_input_in_output", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
    ]


class TritonStream:
    """One client's gRPC stream to the `llm` model, kept open across its requests (as a streaming client
    would), so a request pays no stream set-up."""

    def __init__(self, client, sampling: dict):
        self._sampling = sampling
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses = client.stream_infer(self._request_iterator())

    async def _request_iterator(self):
        while (request := await self._requests.get()) is not None:
            yield request

    async def request(self, prompt: str) -> Timing:
        """Send one prompt and read its streamed responses until the last."""
        inputs = _triton_inputs(prompt, self._sampling)
        timing = Timing(sent=time.perf_counter())
        await self._requests.put({"model_name": "llm", "inputs": inputs})
        seen = 0
        async for result, error in self._responses:
            now = time.perf_counter()
            if error is not None:
                raise RuntimeError(f"request failed: {error}")
            counts = result.as_numpy("num_output_tokens")
            if counts is not None:
                total = int(counts[0])
                timing.arrivals.append(now)
                timing.tokens.append(total - seen)
                seen = total
            # The aio client cannot ask for Triton's final flag; the llm's last response has a finish reason.
            if result.as_numpy("finish_reason")[0]:
                return timing
        raise RuntimeError("the stream ended before the request's last response")

    async def close(self) -> None:
        """End the stream."""
        await self._requests.put(None)


async def _closed_loop(concurrency: int, prompts: list[str], new_client) -> tuple[list[Timing], float]:
    """C workers, each sending its next prompt when the previous request ends."""
    queue = list(reversed(prompts))
    timings: list[Timing] = []

    async def worker():
        stream = new_client()
        try:
            while queue:
                timings.append(await stream.request(queue.pop()))
        finally:
            await stream.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


def run_triton(grpc_url: str, concurrency: int, prompts: list[str], sampling: dict, warmup: list[str]) -> dict:
    """One concurrency level through tritonserver's gRPC streaming, after `warmup` (prompts not in the level,
    so the server's prefix cache holds none of the measured ones)."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            await _closed_loop(concurrency, warmup[:concurrency], lambda: TritonStream(client, sampling))
            return await _closed_loop(concurrency, prompts, lambda: TritonStream(client, sampling))
        finally:
            await client.close()

    timings, wall = asyncio.run(main())
    return summarize(timings, wall)


def _inprocess_timings(engine, concurrency: int, prompts: list[str], sampling: dict) -> tuple[list[Timing], float]:
    from pagedserve.backend.sampling_params import SamplingParams

    params = SamplingParams.from_dict(sampling)
    pending = list(reversed(prompts))
    timings: dict[str, Timing] = {}

    def admit() -> None:
        rid = f"bench-{time.perf_counter_ns()}-{len(timings)}"
        timings[rid] = Timing(sent=time.perf_counter())
        engine.add_request(rid, pending.pop(), params)

    start = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        admit()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = sum(len(c.token_ids_delta) for c in out.outputs)
            if new:
                timings[out.request_id].arrivals.append(now)
                timings[out.request_id].tokens.append(new)
            if out.finished and pending:
                admit()
    return list(timings.values()), time.perf_counter() - start


def run_inprocess(engine, concurrency: int, prompts: list[str], sampling: dict) -> dict:
    """The same closed loop on the in-process engine, one thread, timestamps taken at each step's end."""
    return summarize(*_inprocess_timings(engine, concurrency, prompts, sampling))


def run_alternating(engine, grpc_url: str, prompts: list[str], sampling: dict, warmup: list[str]) -> tuple:
    """Concurrency 1 on both paths, request by request in turn: (in-process, Triton, paired TTFT added).

    Each path's wall time is the sum of its own requests' durations; the paired figures are Triton's TTFT
    minus the in-process TTFT for the same prompt, in milliseconds, in prompt order.
    """
    import tritonclient.grpc.aio as grpcclient

    async def main():
        client = grpcclient.InferenceServerClient(grpc_url)
        stream = TritonStream(client, sampling)
        local, remote, walls = [], [], [0.0, 0.0]
        try:
            await stream.request(warmup[0])
            for prompt in prompts:
                timings, wall = _inprocess_timings(engine, 1, [prompt], sampling)
                local += timings
                walls[0] += wall
                start = time.perf_counter()
                remote.append(await stream.request(prompt))
                walls[1] += time.perf_counter() - start
        finally:
            await stream.close()
            await client.close()
        return local, remote, walls

    local, remote, (local_wall, remote_wall) = asyncio.run(main())
    paired = [(r.arrivals[0] - r.sent - (i.arrivals[0] - i.sent)) * 1e3 for i, r in zip(local, remote, strict=True)]
    return summarize(local, local_wall), summarize(remote, remote_wall), [round(d, 3) for d in paired]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model (smoke run)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=32, help="at least this many requests per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=16)
    parser.add_argument("--max-words", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="engine parameter for both paths, e.g. device=cpu")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for both paths (OMP_NUM_THREADS for the server)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serving.json")
    args = parser.parse_args()

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by tritonserver's stubs
    from pagedserve.backend.engine import LLMEngine
    from pagedserve.client.launcher import (
        DEFAULT_MODEL_REPOSITORY,
        TritonServer,
        free_loopback_ports,
        prepare_model_repository,
    )

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    if args.tiny:
        from pagedserve.backend.testing import make_tiny_model

        model = str(make_tiny_model(work / "tiny", "llama"))
    elif args.model:
        model = str(Path(args.model).resolve())
    else:
        from pagedserve.backend.default_model import ensure_default_model

        model = str(ensure_default_model())
    params = dict(p.split("=", 1) for p in args.param)
    params.setdefault("max_num_seqs", str(max(args.concurrency)))
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    levels = {c: make_workload(max(c * args.requests_per_client, args.min_requests), args.seed + c,
                               args.min_words, args.max_words)
              for c in args.concurrency}
    # Warm-up prompts share no level's seed: neither path's prefix cache starts with a measured prompt.
    warmup = make_workload(max(args.concurrency), args.seed + 1_000_003, args.min_words, args.max_words)

    print(f"in-process engine and tritonserver: {model}", flush=True)
    engine = LLMEngine.from_pretrained(model, **{k: _typed(v) for k, v in params.items()})
    engine.generate(warmup[:1], None)
    device = str(engine.runner.device)
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, work / "models", model, params)
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    server = TritonServer(repository, work_dir=work, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=work / "tritonserver.log")
    inprocess, triton, paired = {}, {}, {}
    with server:
        server.wait_ready(900)
        # Interleaved per level, so a change in the shared machine's load hits both paths alike.
        for c, prompts in levels.items():
            if c == 1:
                inprocess[c], triton[c], paired[c] = run_alternating(engine, server.grpc_url, prompts, sampling,
                                                                     warmup)
            else:
                inprocess[c] = run_inprocess(engine, c, prompts, sampling)
                triton[c] = run_triton(server.grpc_url, c, prompts, sampling, warmup)
            print(f"  concurrency {c}: in-process {inprocess[c]['tok_s']} tok/s, triton {triton[c]['tok_s']} tok/s",
                  flush=True)

    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "device": device,
                    "cpu_count": os.cpu_count(),
                    "load_average_1_5_15": {"before": [round(x, 2) for x in load_before],
                                            "after": [round(x, 2) for x in os.getloadavg()]}},
        "model": Path(model).name,
        "workload": {"sampling": sampling, "requests_per_client": args.requests_per_client,
                     "min_requests": args.min_requests,
                     "prompt_words": [args.min_words, args.max_words], "seed": args.seed, "engine": params,
                     "torch_threads": args.torch_threads},
        "concurrency": {},
    }
    print(f"{'C':>3} {'triton tok/s':>13} {'in-proc tok/s':>14} {'ratio':>6} {'TTFT p50 +ms':>13} "
          f"{'paired +ms':>11} {'ITL p50 ms':>11} {'E2E p99 ms':>11}")
    for c in args.concurrency:
        t, i = triton[c], inprocess[c]
        row = {
            "triton_tok_s": t["tok_s"],
            "inprocess_tok_s": i["tok_s"],
            "ratio": round(t["tok_s"] / i["tok_s"], 3),
            "ttft_ms_p50_added": round(t["ttft_ms"]["p50"] - i["ttft_ms"]["p50"], 3),
            "triton": t,
            "inprocess": i,
        }
        if c in paired:
            row["ttft_ms_added_paired_p50"] = round(float(np.median(paired[c])), 3)
            row["ttft_ms_added_paired"] = paired[c]
        results["concurrency"][str(c)] = row
        print(f"{c:>3} {row['triton_tok_s']:>13.1f} {row['inprocess_tok_s']:>14.1f} {row['ratio']:>6.3f} "
              f"{row['ttft_ms_p50_added']:>13.2f} {row.get('ttft_ms_added_paired_p50', float('nan')):>11.2f} "
              f"{t['itl_ms']['p50']:>11.2f} "
              f"{t['e2e_ms']['p99']:>11.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _typed(value: str) -> int | float | bool | str:
    """A config.pbtxt string parameter as the engine kwarg the llm model would pass."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return value


if __name__ == "__main__":
    sys.exit(main())
