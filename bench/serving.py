"""Serving through Triton vs the in-process engine, on one seeded workload.

`python bench/serving.py` starts tritonserver (the pagedserve repository) and drives the `llm` model
with tritonclient gRPC streaming at concurrency 1, 8 and 32 (closed loop: each of C clients, one gRPC
stream each, sends its next request when the previous one ends), and runs the same requests on an
in-process `LLMEngine` with the same concurrency, the two interleaved level by level; at concurrency 1
they alternate request by request, so both paths see the same machine load and the TTFT difference can
be paired per prompt. At higher concurrency the in-process engine also replays the Triton run's requests
at the moments its clients sent them (the closed in-process loop resubmits at the very step boundary
where a request ends, which no network client can), so the TTFT difference is also measured against the
same arrivals. It reports TTFT, inter-token latency and end-to-end latency (p50/p90/p99) and output
tokens/s for both, the throughput ratio and the TTFT the Triton path adds, and writes
bench/results/serving.json. `--tiny` uses a tiny random model (a smoke run of the wiring).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from serving_metrics import ServerSideTTFT, Timing, make_workload, path_ttft_ms, summarize

REPO = Path(__file__).resolve().parent.parent
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
        timing = Timing(sent=time.perf_counter(), prompt=prompt)
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


def run_triton(server, concurrency: int, prompts: list[str], sampling: dict,
               warmup: list[str], processes: int = 1) -> tuple[dict, list[Timing]]:
    """One concurrency level through tritonserver's gRPC streaming, after `warmup` (prompts not in the level,
    so the server's prefix cache holds none of the measured ones): its summary (with the TTFT split between
    the engine and the path around it) and per-request timings. With `processes` > 1 the C clients are
    spread over that many client processes (`_client_process`), so that no one asyncio loop handles every
    stream's responses."""
    processes = min(processes, concurrency)
    if processes > 1:
        timings, wall, server_means = _run_client_processes(server, concurrency, prompts, sampling, warmup,
                                                            processes)
    else:
        server_side: list[ServerSideTTFT] = []
        timings, wall = asyncio.run(_warm_then_measure(
            server.grpc_url, concurrency, prompts, warmup[:concurrency], sampling,
            between=lambda: server_side.append(ServerSideTTFT(server))))
        server_means = server_side[0].means_ms()
    summary = summarize(timings, wall)
    summary["ttft_ms_path"] = path_ttft_ms(timings, server_means)
    return summary, timings


async def _warm_then_measure(grpc_url: str, concurrency: int, prompts: list[str], warmup: list[str],
                             sampling: dict, between) -> tuple[list[Timing], float]:
    """One client's closed loops on one gRPC channel: the warm-up prompts, then `between()` (read the
    server's counters, or wait for the other client processes), then the measured prompts."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        await _closed_loop(concurrency, warmup, lambda: TritonStream(client, sampling))
        between()
        return await _closed_loop(concurrency, prompts, lambda: TritonStream(client, sampling))
    finally:
        await client.close()


def _client_process(grpc_url: str, concurrency: int, prompts: list[str], warmup: list[str], sampling: dict,
                    warmed, go, results) -> None:
    """One client process of a multi-process level: warm up, wait until every process has (`warmed`) and
    the server's counters are read (`go`), run its closed loop, hand back its timings as tuples."""
    timings, _ = asyncio.run(_warm_then_measure(grpc_url, concurrency, prompts, warmup, sampling,
                                                between=lambda: (warmed.wait(), go.wait())))
    results.put([(t.sent, t.prompt, t.arrivals, t.tokens) for t in timings])


def _run_client_processes(server, concurrency: int, prompts: list[str], sampling: dict, warmup: list[str],
                          processes: int) -> tuple[list[Timing], float, tuple]:
    """The level's C clients spread over `processes` client processes, prompts dealt round-robin. The
    processes' perf_counter clocks are the same (CLOCK_MONOTONIC), so their timings merge."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # this process holds torch threads and an engine
    warmed, go, results = context.Barrier(processes + 1), context.Barrier(processes + 1), context.Queue()
    shares = [concurrency // processes + (p < concurrency % processes) for p in range(processes)]
    workers = [context.Process(target=_client_process, daemon=True,
                               args=(server.grpc_url, shares[p], prompts[p::processes],
                                     warmup[:concurrency][p::processes], sampling, warmed, go, results))
               for p in range(processes)]
    for worker in workers:
        worker.start()
    warmed.wait(timeout=600)
    server_side = ServerSideTTFT(server)
    go.wait(timeout=60)
    timings = [Timing(sent=sent, prompt=prompt, arrivals=arrivals, tokens=tokens)
               for _ in workers for sent, prompt, arrivals, tokens in results.get(timeout=3600)]
    server_means = server_side.means_ms()
    for worker in workers:
        worker.join(timeout=60)
    wall = max(t.arrivals[-1] for t in timings if t.arrivals) - min(t.sent for t in timings)
    return timings, wall, server_means


def _inprocess_timings(engine, concurrency: int, prompts: list[str], sampling: dict) -> tuple[list[Timing], float]:
    from pagedserve.backend.core.sampling_params import SamplingParams

    params = SamplingParams.from_dict(sampling)
    pending = list(reversed(prompts))
    timings: dict[str, Timing] = {}

    def admit() -> None:
        rid = f"bench-{time.perf_counter_ns()}-{len(timings)}"
        prompt = pending.pop()
        timings[rid] = Timing(sent=time.perf_counter(), prompt=prompt)
        engine.add_request(rid, prompt, params)

    start = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        admit()
    while engine.has_unfinished_requests():
        for out in _step(engine, timings):
            if out.finished and pending:
                admit()
    return list(timings.values()), time.perf_counter() - start


def _step(engine, timings: dict[str, Timing]) -> list:
    """One engine step, its new tokens recorded at the step's end (when a server would send them)."""
    outputs = engine.step()
    now = time.perf_counter()
    for out in outputs:
        new = sum(len(c.token_ids_delta) for c in out.outputs)
        if new:
            timings[out.request_id].arrivals.append(now)
            timings[out.request_id].tokens.append(new)
    return outputs


def run_replay(engine, recorded: list[Timing], sampling: dict) -> tuple[dict, list[Timing]]:
    """The in-process engine fed a Triton run's requests at the moments its clients sent them.

    A closed loop in process resubmits at the very step boundary where a request ends, so its C requests
    always start together in one step; requests that reach a server over the network arrive spread out,
    and the first to reach an idle engine starts alone. Replaying the recorded send times (offsets from the
    level's first send) gives the in-process engine the same arrivals: each request joins at the first step
    boundary after it was sent, an idle engine waits for the next arrival, and TTFT counts from the send.
    The difference to Triton's TTFT is then the path's own cost, not the two loops' arrival patterns.
    """
    from pagedserve.backend.core.sampling_params import SamplingParams

    params = SamplingParams.from_dict(sampling)
    engine.scheduler.reset_prefix_cache()  # the closed loop just ran these prompts; Triton's cache had them once
    origin = min(t.sent for t in recorded)
    arrivals = sorted((t.sent - origin, t.prompt) for t in recorded)
    timings: dict[str, Timing] = {}
    start = time.perf_counter()
    next_arrival = 0
    while next_arrival < len(arrivals) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + arrivals[next_arrival][0] - time.perf_counter()))
        now = time.perf_counter()
        while next_arrival < len(arrivals) and start + arrivals[next_arrival][0] <= now:
            offset, prompt = arrivals[next_arrival]
            rid = f"replay-{next_arrival}"
            timings[rid] = Timing(sent=start + offset, prompt=prompt)
            engine.add_request(rid, prompt, params)
            next_arrival += 1
        if engine.has_unfinished_requests():
            _step(engine, timings)
    return summarize(list(timings.values()), time.perf_counter() - start), list(timings.values())


def paired_ttft_ms(inprocess: list[Timing], triton: list[Timing]) -> list[float]:
    """Triton's TTFT minus the in-process TTFT of the same prompt, in milliseconds, in Triton's send order."""
    local = {t.prompt: (t.arrivals[0] - t.sent) for t in inprocess if t.arrivals}
    return [round((t.arrivals[0] - t.sent - local[t.prompt]) * 1e3, 3)
            for t in sorted(triton, key=lambda t: t.sent) if t.arrivals and t.prompt in local]


def run_inprocess(engine, concurrency: int, prompts: list[str], sampling: dict) -> dict:
    """The same closed loop on the in-process engine, one thread, timestamps taken at each step's end."""
    return summarize(*_inprocess_timings(engine, concurrency, prompts, sampling))


def run_alternating(engine, server, prompts: list[str], sampling: dict, warmup: list[str]) -> tuple:
    """Concurrency 1 on both paths, request by request in turn: (in-process, Triton, paired TTFT added).

    Each path's wall time is the sum of its own requests' durations; the paired figures are Triton's TTFT
    minus the in-process TTFT for the same prompt, in milliseconds, in prompt order. Each request reaches an
idle engine on both paths, so the two see the same arrivals.
    """
    import tritonclient.grpc.aio as grpcclient

    async def main():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        stream = TritonStream(client, sampling)
        local, remote, walls = [], [], [0.0, 0.0]
        try:
            await stream.request(warmup[0])
            server_side = ServerSideTTFT(server)
            for prompt in prompts:
                timings, wall = _inprocess_timings(engine, 1, [prompt], sampling)
                local += timings
                walls[0] += wall
                start = time.perf_counter()
                remote.append(await stream.request(prompt))
                walls[1] += time.perf_counter() - start
            server_means = server_side.means_ms()
        finally:
            await stream.close()
            await client.close()
        return local, remote, walls, server_means

    local, remote, (local_wall, remote_wall), server_means = asyncio.run(main())
    summary = summarize(remote, remote_wall)
    summary["ttft_ms_path"] = path_ttft_ms(remote, server_means)
    return summarize(local, local_wall), summary, paired_ttft_ms(local, remote)


def _parse_args() -> argparse.Namespace:
    """The command line."""
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
    parser.add_argument("--client-processes", type=int, default=1,
                        help="spread the Triton path's clients over this many processes (at concurrency > 1)")
    parser.add_argument("--server-param", action="append", default=[], metavar="KEY=VALUE",
                        help="llm model parameter for the Triton path only, e.g. response_threads=2")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for both paths (OMP_NUM_THREADS for the server)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serving.json")
    return parser.parse_args()


def main() -> int:
    """Run both paths level by level, print the table, write the JSON."""
    args = _parse_args()

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by tritonserver's stubs
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.client.launcher import (
        DEFAULT_MODEL_REPOSITORY,
        TritonServer,
        free_loopback_ports,
        prepare_model_repository,
    )

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    model = _model_folder(args, work)
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
    server_params = dict(p.split("=", 1) for p in args.server_param)
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, work / "models", model,
                                          {**params, **server_params})
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    server = TritonServer(repository, work_dir=work, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=work / "tritonserver.log")
    with server:
        server.wait_ready(900)
        runs = _run_levels(engine, server, levels, sampling, warmup, args.client_processes)

    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "device": device,
                    "cpu_count": os.cpu_count(),
                    "load_average_1_5_15": {"before": [round(x, 2) for x in load_before],
                                            "after": [round(x, 2) for x in os.getloadavg()]}},
        "model": Path(model).name,
        "workload": {"sampling": sampling, "requests_per_client": args.requests_per_client,
                     "min_requests": args.min_requests,
                     "prompt_words": [args.min_words, args.max_words], "seed": args.seed, "engine": params,
                     "llm_model": server_params, "client_processes": args.client_processes,
                     "torch_threads": args.torch_threads},
        "concurrency": _report(args.concurrency, *runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _model_folder(args: argparse.Namespace, work: Path) -> str:
    """The model both paths serve: a tiny random one, the given folder, or the default model."""
    if args.tiny:
        from pagedserve.testing import make_tiny_model

        return str(make_tiny_model(work / "tiny", "llama"))
    if args.model:
        return str(Path(args.model).resolve())
    from pagedserve.backend.model.default_model import ensure_default_model

    return str(ensure_default_model())


def _run_levels(engine, server, levels: dict[int, list[str]], sampling: dict, warmup: list[str],
                client_processes: int) -> tuple[dict, dict, dict, dict]:
    """(triton, in-process, in-process on the same arrivals, paired TTFT differences) by concurrency."""
    inprocess, triton, matched, paired = {}, {}, {}, {}
    # Interleaved per level, so a change in the shared machine's load hits both paths alike.
    for c, prompts in levels.items():
        if c == 1:
            inprocess[c], triton[c], paired[c] = run_alternating(engine, server, prompts, sampling, warmup)
            matched[c] = inprocess[c]
        else:
            inprocess[c] = run_inprocess(engine, c, prompts, sampling)
            triton[c], sent = run_triton(server, c, prompts, sampling, warmup, client_processes)
            matched[c], replayed = run_replay(engine, sent, sampling)
            paired[c] = paired_ttft_ms(replayed, sent)
        print(f"  concurrency {c}: in-process {inprocess[c]['tok_s']} tok/s, triton {triton[c]['tok_s']} tok/s",
              flush=True)
    return triton, inprocess, matched, paired


def _report(levels: list[int], triton: dict, inprocess: dict, matched: dict, paired: dict) -> dict:
    """Print one table row per concurrency and return the rows: throughput ratio and the TTFT the path adds."""
    rows = {}
    print(f"{'C':>3} {'triton tok/s':>13} {'in-proc tok/s':>14} {'ratio':>6} {'TTFT p50 +ms':>13} "
          f"{'same-arrivals +ms':>18} {'paired +ms':>11} {'path +ms':>9} {'queue ms':>9} {'ITL p50 ms':>11} {'E2E p99 ms':>11}")
    for c in levels:
        t, i, m = triton[c], inprocess[c], matched[c]
        row = {
            "triton_tok_s": t["tok_s"],
            "inprocess_tok_s": i["tok_s"],
            "ratio": round(t["tok_s"] / i["tok_s"], 3),
            # Against the closed in-process loop (at 1: the request-by-request alternation).
            "ttft_ms_p50_added": round(t["ttft_ms"]["p50"] - i["ttft_ms"]["p50"], 3),
            # Per prompt against the in-process engine given the same arrivals (at 1 the alternation is that).
            "ttft_ms_added_paired_p50": round(float(np.median(paired[c])), 3),
            # Client TTFT minus the model's own (server-side) TTFT, means: the path around the engine.
            "ttft_ms_mean_added_by_path": t["ttft_ms_path"]["added_mean"],
            "triton": t,
            "inprocess": i,
        }
        if m is not i:
            # Against the in-process engine replaying the Triton run's send times (run_replay).
            row["ttft_ms_p50_added_same_arrivals"] = round(t["ttft_ms"]["p50"] - m["ttft_ms"]["p50"], 3)
            row["inprocess_same_arrivals"] = m
        row["ttft_ms_added_paired"] = paired[c]
        rows[str(c)] = row
        print(f"{c:>3} {row['triton_tok_s']:>13.1f} {row['inprocess_tok_s']:>14.1f} {row['ratio']:>6.3f} "
              f"{row['ttft_ms_p50_added']:>13.2f} {row.get('ttft_ms_p50_added_same_arrivals', float('nan')):>18.2f} "
              f"{row['ttft_ms_added_paired_p50']:>11.2f} {_num(row['ttft_ms_mean_added_by_path']):>9.2f} "
              f"{_num(t['ttft_ms_path']['triton_queue_mean']):>9.2f} "
              f"{t['itl_ms']['p50']:>11.2f} "
              f"{t['e2e_ms']['p99']:>11.1f}")
    return rows


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


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
