"""`pagedserve bench`: the seeded workload, the summary, and one small run against the session tritonserver."""

from __future__ import annotations

import json
import math

import pytest

from pagedserve.client.bench import RequestResult, arrival_delays, make_workload, summarize
from pagedserve.client.cli import main

NUM_PROMPTS = 6


def test_workload_is_seeded_and_lengths_stay_in_bounds():
    first = make_workload(50, seed=3, input_len=32, output_len=16, max_input_len=64, max_output_len=20)
    again = make_workload(50, seed=3, input_len=32, output_len=16, max_input_len=64, max_output_len=20)
    other = make_workload(50, seed=4, input_len=32, output_len=16, max_input_len=64, max_output_len=20)
    assert first == again and first != other
    assert all(4 <= w.prompt_words <= 64 and len(w.prompt.split()) == w.prompt_words for w in first)
    assert all(1 <= w.output_len <= 20 for w in first)
    assert len({w.output_len for w in first}) > 3, "lengths should vary like a real trace"


def test_poisson_arrivals_follow_the_rate_and_infinite_rate_sends_at_once():
    times = arrival_delays(2000, request_rate=4.0, seed=0)
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / len(times) == pytest.approx(0.25, rel=0.1)
    assert arrival_delays(5, math.inf, seed=0) == [0.0] * 5


def test_summary_percentiles_and_throughput():
    results = [
        RequestResult(ok=True, ttft=0.1, latency=1.0, itls=[0.01, 0.03], prompt_tokens=5, output_tokens=3),
        RequestResult(ok=True, ttft=0.3, latency=2.0, itls=[0.02], prompt_tokens=5, output_tokens=2),
        RequestResult(ok=False, error="boom"),
    ]
    summary = summarize(results, duration=2.5)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, ["boom"])
    assert summary["output_throughput"] == pytest.approx(5 / 2.5)
    assert summary["request_throughput"] == pytest.approx(2 / 2.5)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(20.0)
    assert summary["e2e_ms"]["p99"] == pytest.approx(1990.0)


@pytest.mark.slow
def test_bench_against_triton_generates_exactly_the_requested_tokens(triton_server, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "bench.json"
    code = main(["bench", "--backend", "triton", "--url", triton_server.grpc_url, "--num-prompts", str(NUM_PROMPTS),
                 "--input-len", "16", "--output-len", "6", "--max-input-len", "64", "--max-output-len", "12",
                 "--request-rate", "20", "--seed", "5", "--no-progress", "--output", str(out)])
    table = capsys.readouterr().out
    assert code == 0 and "TTFT" in table and f"{NUM_PROMPTS}/{NUM_PROMPTS} ok" in table
    summary = json.loads(out.read_text())
    workload = make_workload(NUM_PROMPTS, 5, 16, 6, 64, 12)
    assert (summary["num_requests"], summary["completed"], summary["failed"], summary["errors"]) == (
        NUM_PROMPTS, NUM_PROMPTS, 0, [])
    # ignore_eos: each request generates exactly its drawn length; its prompt is as long as the tokenizer says.
    assert summary["output_tokens"] == sum(w.output_len for w in workload)
    tokenizer = AutoTokenizer.from_pretrained(triton_server.model_path)
    assert summary["prompt_tokens"] == sum(len(tokenizer(w.prompt).input_ids) for w in workload)
    duration = summary["duration_s"]
    assert summary["output_throughput"] == pytest.approx(summary["output_tokens"] / duration)
    assert summary["request_throughput"] == pytest.approx(NUM_PROMPTS / duration)
    ttft, itl, e2e = summary["ttft_ms"], summary["itl_ms"], summary["e2e_ms"]
    for stats in (ttft, itl, e2e):
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= duration * 1000, stats
    # Each request's first token comes before its end, so every TTFT statistic is below e2e's.
    assert all(ttft[key] < e2e[key] for key in ("mean", "p50", "p90", "p99")), (ttft, e2e)
