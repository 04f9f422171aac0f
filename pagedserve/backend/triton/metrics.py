"""The engine's metrics on Triton's /metrics page, through pb_utils.MetricFamily, with vLLM's names."""

from __future__ import annotations

import threading
import time
from typing import Any

import triton_python_backend_utils as pb_utils

from pagedserve.backend.triton.lora import lora_info_labels

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0]

# EngineStats field -> (metric name, description) for the monotonically growing counts.
_COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "mm_cache_queries": ("vllm:mm_cache_queries", "Images looked up in the encoder cache."),
    "mm_cache_hits": ("vllm:mm_cache_hits", "Images found in the encoder cache (not encoded again)."),
    "num_preemptions": ("vllm:num_preemptions_total", "Requests preempted (recomputed) for lack of KV blocks."),
    "prompt_tokens": ("vllm:prompt_tokens_total", "Prompt tokens processed."),
    "generation_tokens": ("vllm:generation_tokens_total", "Tokens generated."),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts_total", "Speculative draft runs verified."),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
}
_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Requests in the running batch."),
    "num_waiting": ("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."),
}
STEP_FAILURES_METRIC = "pagedserve:engine_step_failures_total"
ACCEPTED_PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
LORA_INFO_METRIC = "vllm:lora_requests_info"
CACHE_CONFIG_METRIC = "vllm:cache_config_info"
_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token."),
    "itl": ("vllm:inter_token_latency_seconds", "Time between two generated tokens of one request."),
    "e2e": ("vllm:e2e_request_latency_seconds", "Time from arrival to the end of the request."),
}


# Metric calls from two stub threads at once crashed tritonserver 2.51 (SIGSEGV in libtriton_python.so, then
# boost::interprocess::lock_exception): with several response threads every call goes through this lock.
_LOCK = threading.Lock()


class EngineMetrics:
    """Gauges, counters and latency histograms of one llm model instance, labelled with its name.

    Each instance is its own stub process with its own engine: without the `instance` label two instances
    would set one gauge in turn (and the first to unload would delete it). Prometheus sums the counters.
    The response threads call it (`update` from one of them only); counters follow the engine's cumulative
    stats. Every change is a round trip to the server that holds the GIL, so unchanged values are not resent.
    """

    def __init__(self, model_name: str, model_version: str, instance_name: str, engine: str = "0"):
        # engine: the data-parallel rank, vLLM's label that tells a fleet's replicas apart on a dashboard.
        labels = {"model": model_name, "version": model_version, "instance": instance_name, "engine": engine}
        self._families = []
        self._counters: dict[str, Any] = {}
        self._gauges: dict[str, Any] = {}
        self._histograms: dict[str, Any] = {}
        for kind, specs, target in (
            (pb_utils.MetricFamily.COUNTER, _COUNTERS, self._counters),
            (pb_utils.MetricFamily.GAUGE, _GAUGES, self._gauges),
        ):
            for field, (name, description) in specs.items():
                family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
                self._families.append(family)
                target[field] = family.Metric(labels=labels)
        for field, (name, description) in _HISTOGRAMS.items():
            family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.HISTOGRAM)
            self._families.append(family)
            self._histograms[field] = family.Metric(labels=labels, buckets=_LATENCY_BUCKETS)
        self._last_counts = dict.fromkeys(_COUNTERS, 0)
        self._last_gauges: dict[str, float | None] = dict.fromkeys(_GAUGES)
        failures = pb_utils.MetricFamily(name=STEP_FAILURES_METRIC, kind=pb_utils.MetricFamily.COUNTER,
                                         description="Engine steps that raised; their requests ended with an error.")
        self._families.append(failures)
        self._step_failures = failures.Metric(labels=labels)
        self._accepted_per_pos = AcceptedPerPosition(labels)
        self._lora_info = LoRAInfo(labels)
        self._labels = labels
        self._cache_info: Any = None

    def describe_cache(self, cache_labels: dict[str, str]) -> None:
        """vLLM's vllm:cache_config_info gauge (value 1, the cache's settings in its labels): a router's endpoint
        picker reads block_size from it."""
        with _LOCK:
            family = pb_utils.MetricFamily(name=CACHE_CONFIG_METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                           description="Information of the LLMEngine CacheConfig")
            self._families.append(family)
            self._cache_info = family.Metric(labels={**self._labels, **cache_labels})
            self._cache_info.set(1.0)

    def close(self) -> None:
        """Delete the metrics now, while the stub still talks to the server: left to the interpreter's exit,
        their destructors wrote to the stub's freed shared memory and crashed it (tritonserver 2.51)."""
        with _LOCK:
            self._counters.clear()
            self._gauges.clear()
            self._histograms.clear()
            self._step_failures = None
            self._cache_info = None
            self._accepted_per_pos.close()
            self._lora_info.close()
            self._families.clear()

    def update(self, stats: Any) -> None:
        """Set the gauges and advance the counters from an EngineStats snapshot."""
        with _LOCK:
            self._update(stats)

    def _update(self, stats: Any) -> None:
        for field, gauge in self._gauges.items():
            value = float(getattr(stats, field))
            if value != self._last_gauges[field]:
                gauge.set(value)
                self._last_gauges[field] = value
        for field, counter in self._counters.items():
            value = int(getattr(stats, field))
            if value > self._last_counts[field]:
                counter.increment(value - self._last_counts[field])
                self._last_counts[field] = value
        self._accepted_per_pos.update(stats.spec_decode_num_accepted_tokens_per_pos)
        self._lora_info.update(stats)

    def count_step_failure(self) -> None:
        """One engine step failed (its requests were ended with an error)."""
        self._step_failures.increment(1)

    def observe(self, histogram: str, seconds: float) -> None:
        """Record one latency sample: `histogram` is "ttft", "itl" or "e2e"."""
        with _LOCK:
            self._histograms[histogram].observe(seconds)


class AcceptedPerPosition:
    """vLLM's vllm:spec_decode_num_accepted_tokens_per_pos counter: drafts accepted at each draft position,
    one sample per position label (0 first), made when the engine first reports that position."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._family: Any = None
        self._samples: list[Any] = []
        self._last: list[int] = []

    def update(self, counts: list[int]) -> None:
        if counts and self._family is None:
            self._family = pb_utils.MetricFamily(
                name=ACCEPTED_PER_POS_METRIC, kind=pb_utils.MetricFamily.COUNTER,
                description="Draft tokens accepted at each draft position.")
        for position, value in enumerate(counts):
            if position == len(self._samples):
                self._samples.append(self._family.Metric(labels={**self._labels, "position": str(position)}))
                self._last.append(0)
            if value > self._last[position]:
                self._samples[position].increment(value - self._last[position])
                self._last[position] = value

    def close(self) -> None:
        self._samples.clear()
        self._family = None


class LoRAInfo:
    """vLLM's vllm:lora_requests_info gauge: one sample per set of labels seen (the adapters in use). The current
    one holds the time it became current, the others 0 (vLLM leaves them at their old times; either way its
    readers take the newest)."""

    def __init__(self, model_labels: dict[str, str]) -> None:
        self._model_labels = model_labels
        self._family: Any = None
        self._samples: dict[tuple[str, ...], Any] = {}  # every sample made: a pb_utils metric outlives its object
        self._labels: dict[str, str] | None = None

    def update(self, stats: Any) -> None:
        labels = lora_info_labels(stats)
        if labels is None or labels == self._labels:
            return
        if self._family is None:
            self._family = pb_utils.MetricFamily(name=LORA_INFO_METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                                 description="Running stats on LoRA requests.")
        if self._labels is not None:
            self._samples[tuple(self._labels.values())].set(0.0)
        key = tuple(labels.values())
        if key not in self._samples:
            self._samples[key] = self._family.Metric(labels={**self._model_labels, **labels})
        self._samples[key].set(time.time())
        self._labels = labels

    def close(self) -> None:
        self._samples.clear()
        self._family = None


def cache_config_labels(cache_config: Any, num_blocks: int) -> dict[str, str]:
    """vllm:cache_config_info's labels as vLLM writes them (its CacheConfig fields as text): the block size, the
    block count the memory budget bought (num_gpu_blocks, whatever the device), the KV dtype, prefix caching."""
    return {
        "block_size": str(cache_config.block_size),
        "num_gpu_blocks": str(num_blocks),
        "num_cpu_blocks": "None",
        "cache_dtype": str(getattr(cache_config, "kv_cache_dtype", "auto")),
        "enable_prefix_caching": str(cache_config.enable_prefix_caching),
        "gpu_memory_utilization": str(cache_config.gpu_memory_utilization),
    }
