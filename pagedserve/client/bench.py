"""`pagedserve bench`: an online load generator for the Triton gRPC `llm` model or any OpenAI-compatible URL.

Seeded synthetic workload with ShareGPT-like (log-normal) prompt and output lengths, sent at a request
rate (Poisson arrivals) or at a fixed concurrency; reports TTFT, inter-token latency and end-to-end
latency (p50/p90/p99), output tokens/s and requests/s, as a table and JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from pagedserve.client.triton_client import TritonLLMClient

# Plain words that byte-level BPE vocabularies keep whole (with their leading space): ~1 token each.
_WORDS = (
    "the of and to in is was for on are with as by at from this that be have it not or an they which "
    "you one had were all we when there can been has more if will so no out do into than up other time "
    "about some could these two may then first any new like our over such also after most made only"
).split()


@dataclass
class WorkItem:
    """One synthetic request: its prompt, its word count (about its token count) and the output length."""

    prompt: str
    prompt_words: int
    output_len: int


@dataclass
class RequestResult:
    """What the client saw for one request (times in seconds from its send)."""

    ok: bool
    ttft: float = math.nan
    latency: float = math.nan
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


class _TokenClock:
    """Times one request from its send: its first token sets the TTFT, each later one adds an ITL."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.start = self.last = time.perf_counter()

    def token(self) -> None:
        """A token (a response with new text) arrived now."""
        now = time.perf_counter()
        if math.isnan(self.result.ttft):
            self.result.ttft = now - self.start
        else:
            self.result.itls.append(now - self.last)
        self.last = now

    def finish(self) -> RequestResult:
        """The request ended well now."""
        self.result.latency = time.perf_counter() - self.start
        self.result.ok = True
        return self.result


def make_workload(num_prompts: int, seed: int, input_len: int, output_len: int,
                  max_input_len: int, max_output_len: int) -> list[WorkItem]:
    """Seeded prompts and output lengths, log-normal around the given medians like ShareGPT's."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        n_in = min(max_input_len, max(4, round(rng.lognormvariate(math.log(input_len), 0.6))))
        n_out = min(max_output_len, max(1, round(rng.lognormvariate(math.log(output_len), 0.6))))
        words = [rng.choice(_WORDS) for _ in range(n_in)]
        items.append(WorkItem(" ".join(words).capitalize(), n_in, n_out))
    return items


def arrival_delays(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) for a Poisson process of `request_rate` per second."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


# --------------------------------------------------------------------------- one request per backend


async def triton_request(client: TritonLLMClient, item: WorkItem) -> RequestResult:
    """Stream one request through the `llm` model's gRPC endpoint."""
    params = {"max_tokens": item.output_len, "ignore_eos": True, "temperature": 0.0}
    result = RequestResult(ok=False)
    clock = _TokenClock(result)
    try:
        async for response in client.generate(item.prompt, sampling_parameters=params, stream=True):
            if not response.text[0]:
                continue
            clock.token()
            result.prompt_tokens = response.num_input_tokens or result.prompt_tokens
            result.output_tokens = (response.num_output_tokens or [result.output_tokens])[0]
    except Exception as error:  # every failure is counted, none stops the run
        result.error = str(error)
        return result
    return clock.finish()


async def openai_request(http, url: str, model: str, item: WorkItem, chat: bool,
                         api_key: str | None) -> RequestResult:
    """Stream one request through an OpenAI-compatible server (usage from include_usage)."""
    body: dict = {"model": model, "max_tokens": item.output_len, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    endpoint = f"{url}/chat/completions" if chat else f"{url}/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(ok=False)
    clock = _TokenClock(result)
    try:
        async with http.stream("POST", endpoint, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                choices = chunk.get("choices") or []
                text = (choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")) if choices else ""
                if text:
                    clock.token()
    except Exception as error:  # every failure is counted, none stops the run
        result.error = str(error)
        return result
    return clock.finish()


# --------------------------------------------------------------------------- the run


async def run_load(send: Callable[[WorkItem], Awaitable[RequestResult]], items: list[WorkItem],
                   request_rate: float, concurrency: int | None, seed: int,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send `items` at `request_rate` (Poisson) with at most `concurrency` in flight; (results, seconds)."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(items), disable=not progress, unit="req", file=sys.stderr)
    start = time.perf_counter()

    async def one(item: WorkItem, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if limit is None:
            result = await send(item)
        else:
            async with limit:
                result = await send(item)
        bar.update(1)
        return result

    delays = arrival_delays(len(items), request_rate, seed)
    results = await asyncio.gather(*(one(item, at) for item, at in zip(items, delays, strict=True)))
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Percentiles (ms) of TTFT, ITL and end-to-end latency; throughput in tokens/s and requests/s."""
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "p50": None, "p90": None, "p99": None}
        ms = np.asarray(values) * 1000.0
        return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
                "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}

    output_tokens = sum(r.output_tokens for r in done)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "ttft_ms": stats([r.ttft for r in done if not math.isnan(r.ttft)]),
        "itl_ms": stats([x for r in done for x in r.itls]),
        "e2e_ms": stats([r.latency for r in done]),
    }


def format_table(summary: dict) -> str:
    """A plain-text table of one run's summary."""

    def cell(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        f"requests   {summary['completed']}/{summary['num_requests']} ok in {summary['duration_s']:.1f} s",
        f"throughput {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "itl", "e2e"):
        s = summary[f"{name}_ms"]
        lines.append(f"{name.upper():<6}" + "".join(f"{cell(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    if summary["errors"]:
        lines.append("errors: " + "; ".join(summary["errors"]))
    return "\n".join(lines)


async def benchmark(args: argparse.Namespace) -> dict:
    """Run the load described by the command-line arguments and return its summary."""
    items = make_workload(args.num_prompts, args.seed, args.input_len, args.output_len,
                          args.max_input_len, args.max_output_len)
    if args.backend == "triton":
        client = TritonLLMClient(args.url)
        try:
            results, duration = await run_load(lambda item: triton_request(client, item), items,
                                               args.request_rate, args.concurrency, args.seed, not args.no_progress)
        finally:
            await client.close()
    else:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
            url = args.url.rstrip("/")
            model = args.model or await _first_model(http, url, args.api_key)
            chat = args.endpoint == "chat"
            if args.endpoint in ("responses", "messages"):
                from pagedserve.client.bench_apis import api_request

                def send(item):
                    return api_request(http, url, model, item, args.endpoint, args.api_key)
            else:
                def send(item):
                    return openai_request(http, url, model, item, chat, args.api_key)
            results, duration = await run_load(send, items, args.request_rate, args.concurrency, args.seed,
                                               not args.no_progress)
    summary = summarize(results, duration)
    summary["config"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "api_key"}
    summary["config"]["request_rate"] = str(args.request_rate)
    return summary


async def _first_model(http, url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = await http.get(f"{url}/models", headers=headers)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedserve bench`."""
    parser.add_argument("--backend", choices=("triton", "openai"), default="triton",
                        help="triton: the llm model over gRPC; openai: any OpenAI-compatible /v1 URL")
    parser.add_argument("--url", default=None,
                        help="gRPC HOST:PORT (triton, default localhost:8001) or base URL ending in /v1 (openai)")
    parser.add_argument("--model", default=None, help="model id for OpenAI servers (default: the first listed)")
    parser.add_argument("--endpoint", choices=("completions", "chat", "responses", "messages"), default="completions",
                        help="with --backend openai: /completions, /chat/completions, /responses or Anthropic's /messages")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: all at once)")
    parser.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--input-len", type=int, default=128, help="median prompt length in words (~tokens)")
    parser.add_argument("--output-len", type=int, default=128, help="median output length in tokens")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the JSON summary to this file")
    parser.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table (or JSON) and optionally save the JSON."""
    if args.url is None:
        args.url = "localhost:8001" if args.backend == "triton" else "http://localhost:9000/v1"
    for name in ("num_prompts", "input_len", "output_len", "max_input_len", "max_output_len"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.request_rate <= 0 or (args.concurrency is not None and args.concurrency < 1):
        print("error: --request-rate must be > 0 and --concurrency >= 1", file=sys.stderr)
        return 2
    summary = asyncio.run(benchmark(args))
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
