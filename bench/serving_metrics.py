"""The serving benchmark's measurements: seeded prompts, one request's client-side clock, latency percentiles
and tokens/s, and what the server itself saw of a run (its TTFT histogram and Triton's queue time)."""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass, field

import numpy as np

WORDS = ("the quick brown fox jumps over lazy dog paged attention stores keys and values in blocks "
         "a scheduler runs one token budget per step while requests arrive and leave").split()


@dataclass
class Timing:
    """One request's client-side clock: send time, the arrival of each response, and tokens per response."""

    sent: float
    prompt: str = ""
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


class ServerSideTTFT:
    """What the server itself saw of a stretch of requests, read off it before and after: the llm model's
    own TTFT histogram (`vllm:time_to_first_token_seconds`: from execute() to the end of the step that made
    the first token) and Triton's queue time (its statistics extension: from the request's arrival in
    tritonserver to execute()). A client's TTFT minus the engine's is what the path around the engine adds:
    the client, the gRPC front end, the stub's hand-over into and out of the engine thread, the response;
    the queue time is tritonserver's share of the way in."""

    NAME = "vllm:time_to_first_token_seconds"

    def __init__(self, server):
        self._metrics_url = server.metrics_url
        self._stats_url = f"http://{server.http_url}/v2/models/llm/stats"
        self._start = self._read()

    def _read(self) -> tuple[float, ...]:
        from pagedserve.client.launcher import fetch_metrics, model_metric

        text = fetch_metrics(self._metrics_url)
        with urllib.request.urlopen(self._stats_url, timeout=10) as reply:
            stats = json.loads(reply.read())["model_stats"][0]["inference_stats"]
        queue, infer = stats["queue"], stats["compute_infer"]
        return (model_metric(text, f"{self.NAME}_sum"), model_metric(text, f"{self.NAME}_count"),
                float(queue["ns"]) / 1e9, float(queue["count"]), float(infer["ns"]) / 1e9, float(infer["count"]))

    def means_ms(self) -> tuple[float | None, float | None, float | None]:
        """(mean engine TTFT, mean Triton queue time, mean execute() time) of the requests since this object
        was made, in ms."""
        now = self._read()

        def mean(total: int, count: int) -> float | None:
            n = now[count] - self._start[count]
            return (now[total] - self._start[total]) / n * 1e3 if n > 0 else None

        return mean(0, 1), mean(2, 3), mean(4, 5)


def path_ttft_ms(timings: list[Timing], server_means_ms: tuple[float | None, ...]) -> dict:
    """Mean client TTFT, mean engine TTFT, their difference (what the path adds), Triton's mean queue time
    and the mean time in the model's execute(), in milliseconds."""
    engine_mean, queue_mean, execute_mean = server_means_ms
    client = [(t.arrivals[0] - t.sent) * 1e3 for t in timings if t.arrivals]
    client_mean = float(np.mean(client)) if client else None
    added = None if client_mean is None or engine_mean is None else client_mean - engine_mean

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {"client_mean": rounded(client_mean), "engine_mean": rounded(engine_mean),
            "added_mean": rounded(added), "triton_queue_mean": rounded(queue_mean),
            "execute_mean": rounded(execute_mean)}
