"""Instance groups and tensor parallelism through tritonserver: one llm engine against two (Triton's
`instance_group` count 2) and against one engine split over two ranks (`tensor_parallel_size` 2, gloo) on this
machine's cores, the same seeded closed-loop workload over gRPC.

Four layouts, each its own tritonserver (the llm model alone): one instance with all the cores as torch
threads (`cpu_threads` unset, torch's default), one instance with one thread (what each of two gets), two
instances (each with half the cores and half the KV budget, the split the llm model makes by itself), and one
instance over two tensor-parallel ranks of one thread each. At each
concurrency, `pagedserve bench`'s workload (log-normal prompt and output lengths, greedy, ignore_eos) runs
`--rounds` times per layout, the layouts in ABC then CBA order. Output tokens/s, TTFT and ITL per run; the
result JSON also holds each instance's share of the requests (its vllm:e2e_request_latency_seconds_count).

    python bench/scale.py            # default model (SmolLM2-135M), concurrency 4 and 16, 2 rounds
    python bench/scale.py --quick    # concurrency 8, 1 round, shorter outputs
    python bench/scale.py --random-model --layouts "1 instance, 1 thread" "TP 2, 1 thread each"

The default model's 9 attention heads do not split over two ranks: the TP layout needs another model
(`--model`, or `--random-model`: a random Llama of 8 heads, 4 KV heads, hidden 512, 8 layers, from
pagedserve.testing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.client.bench import make_workload, run_load, summarize, triton_request
from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonServer,
    fetch_metrics,
    free_loopback_ports,
    instance_metrics,
    prepare_model_repository,
)
from pagedserve.client.triton_client import TritonLLMClient

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
E2E_COUNT = "vllm:e2e_request_latency_seconds_count"
# name -> (instances, llm parameters beyond the common ones)
LAYOUTS = {
    "1 instance, all cores": (1, {}),
    "1 instance, 1 thread": (1, {"cpu_threads": "1"}),
    "2 instances": (2, {}),
    "TP 2, 1 thread each": (1, {"tensor_parallel_size": "2", "cpu_threads": "1"}),
}
RANDOM_MODEL = {"hidden_size": 512, "num_heads": 8, "num_kv_heads": 4, "num_layers": 8, "intermediate_size": 1536,
                "max_position_embeddings": 2048}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="an llm parameter for every layout, e.g. dtype=float32")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--random-model", action="store_true",
                        help="a random Llama that splits over two ranks (RANDOM_MODEL) instead of --model")
    parser.add_argument("--quick", action="store_true", help="concurrency 8, one round, 16 prompts of 32 tokens")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.rounds, args.num_prompts, args.output_len = [8], 1, 16, 32
    return args


def start_server(model: str, instances: int, params: dict[str, str], work_dir: Path) -> TritonServer:
    """tritonserver with the llm model alone (`instances` of it) on free loopback ports, ready."""
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, work_dir / "models", model, params,
                                          (instances, None))
    for name in ("ensemble", "preprocessing", "postprocessing"):
        shutil.rmtree(repository / name)
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    server = TritonServer(repository, work_dir=work_dir, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=work_dir / "tritonserver.log")
    server.start()
    server.wait_ready(900)
    return server


async def closed_loop(grpc_url: str, args: argparse.Namespace, concurrency: int, seed: int,
                      num_prompts: int | None = None) -> dict:
    """One seeded workload at `concurrency` requests in flight; `pagedserve bench`'s summary."""
    items = make_workload(num_prompts or args.num_prompts, seed, args.input_len, args.output_len, 4 * args.input_len,
                          4 * args.output_len)
    client = TritonLLMClient(grpc_url)
    try:
        results, duration = await run_load(lambda item: triton_request(client, item), items, float("inf"),
                                           concurrency, seed, False)
    finally:
        await client.close()
    return summarize(results, duration)


def measure_layout(model: str, layout: str, args: argparse.Namespace, common: dict[str, str]) -> list[dict]:
    """Start the layout's server, warm it, run each concurrency once; one record per run."""
    instances, params = LAYOUTS[layout]
    records = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-scale-") as tmp:
        server = start_server(model, instances, {**common, **params}, Path(tmp))
        try:
            asyncio.run(closed_loop(server.grpc_url, args, max(args.concurrency), seed=999, num_prompts=8))  # warm
            for concurrency in args.concurrency:
                before = instance_metrics(fetch_metrics(server.metrics_url), E2E_COUNT)
                summary = asyncio.run(closed_loop(server.grpc_url, args, concurrency, seed=concurrency))
                after = instance_metrics(fetch_metrics(server.metrics_url), E2E_COUNT)
                served = {name: after[name] - before.get(name, 0.0) for name in sorted(after)}
                records.append({"layout": layout, "instances": instances, "concurrency": concurrency,
                                "served_by_instance": served, "load_average": os.getloadavg()[0], **summary})
                print(f"  {layout:24s} c={concurrency:3d}  {summary['output_throughput']:7.1f} tok/s  "
                      f"TTFT p50 {summary['ttft_ms']['p50']:7.1f} ms  ITL p50 {summary['itl_ms']['p50']:6.1f} ms  "
                      f"served {served}", flush=True)
        finally:
            server.stop()
    return records


def table(records: list[dict], layouts: list[str], concurrencies: list[int]) -> str:
    """Median over rounds of tokens/s, TTFT p50 and ITL p50, per layout and concurrency."""
    lines = ["| layout | concurrency | output tok/s (median; runs) | TTFT p50 ms | ITL p50 ms |", "|---|---|---|---|---|"]
    for layout in layouts:
        for concurrency in concurrencies:
            runs = [r for r in records if r["layout"] == layout and r["concurrency"] == concurrency]
            rates = [r["output_throughput"] for r in runs]
            ttft = statistics.median(r["ttft_ms"]["p50"] for r in runs)
            itl = statistics.median(r["itl_ms"]["p50"] for r in runs)
            lines.append(f"| {layout} | {concurrency} | {statistics.median(rates):.1f} "
                         f"({', '.join(f'{x:.1f}' for x in rates)}) | {ttft:.0f} | {itl:.1f} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    model = args.model
    if args.random_model:
        from pagedserve.testing import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="pagedserve-scale-model-")), "llama",
                                    **RANDOM_MODEL))
    elif model is None:
        from pagedserve.backend.model.default_model import ensure_default_model

        model = str(ensure_default_model())
    common = dict(item.split("=", 1) for item in args.param)
    records = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for round_index in range(args.rounds):
        order = list(args.layouts) if round_index % 2 == 0 else list(reversed(args.layouts))
        for layout in order:
            records.extend({"round": round_index, **r} for r in measure_layout(model, layout, args, common))
    print(table(records, args.layouts, args.concurrency))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "started": started, "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                                        "platform": platform.platform(), "python": sys.version.split()[0]},
        "model": model, "config": {k: str(v) for k, v in vars(args).items()}, "runs": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
