"""Sampler behaviour on constructed logits: allowed sets, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.worker.sampler import Sampler, apply_penalties, compute_logprobs

VOCAB = 64
EOS = 63


def make_request(request_id: str, params: SamplingParams, prompt=(1, 2, 3), output=()) -> Request:
    req = Request(request_id, list(prompt), params)
    for tok in output:
        req.append_output_token_id(tok)
    return req


def row_from_probs(probs: list[float]) -> torch.Tensor:
    """Logits over VOCAB whose softmax puts `probs` on the first tokens and spreads the rest thinly."""
    rest = (1.0 - sum(probs)) / (VOCAB - len(probs))
    return torch.tensor([math.log(p) for p in probs] + [math.log(rest)] * (VOCAB - len(probs)))


def draw_many(logits_row: torch.Tensor, params: SamplingParams, rows: int = 512) -> set[int]:
    """Sample `rows` times from one logits row in a single batched call."""
    requests = [make_request(f"r{i}", params) for i in range(rows)]
    out = Sampler({EOS})(logits_row.expand(rows, -1).clone(), requests)
    return set(out.token_ids)


def test_greedy_picks_argmax_and_reports_raw_logprob():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    requests = [make_request(f"g{i}", SamplingParams(temperature=0.0)) for i in range(3)]
    out = Sampler({EOS})(logits, requests)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.top_logprobs == [None, None, None]


def test_top_k_never_leaves_the_k_most_likely():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(row, 5).indices.tolist())
    seen = draw_many(row, SamplingParams(temperature=5.0, top_k=5))
    assert seen <= allowed
    assert len(seen) > 1


def test_top_p_keeps_the_smallest_nucleus():
    row = row_from_probs([0.5, 0.3, 0.1, 0.05])
    seen = draw_many(row, SamplingParams(temperature=1.0, top_p=0.75))
    assert seen == {0, 1}


def test_a_top_p_below_float32_resolution_keeps_the_most_likely_token():
    row = row_from_probs([0.5, 0.3, 0.1, 0.05])
    # 1e-50 rounds to 0.0 in float32; the nucleus is still the top token, not nothing.
    assert draw_many(row, SamplingParams(temperature=1.0, top_p=1e-50), rows=64) == {0}


def test_min_p_drops_tokens_below_the_scaled_maximum():
    row = row_from_probs([0.4, 0.3, 0.15, 0.1])
    seen = draw_many(row, SamplingParams(temperature=1.0, min_p=0.5))
    assert seen == {0, 1}


def test_top_k_top_p_min_p_together_stay_in_the_intersection():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05)
    scaled = row / params.temperature
    order = scaled.argsort(descending=True)
    top_k = order[:10]
    probs_k = torch.softmax(scaled[top_k], -1)
    nucleus = {int(t) for t, before in zip(top_k, probs_k.cumsum(0) - probs_k, strict=True) if before < 0.9}
    probs = torch.softmax(scaled, -1)
    min_p_set = set(torch.nonzero(probs >= 0.05 * probs.max()).flatten().tolist())
    allowed = nucleus & min_p_set
    seen = draw_many(row, params)
    assert seen <= allowed
    assert len(seen) > 1


def test_mixed_batch_samples_each_row_by_its_own_params():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    greedy = make_request("greedy", SamplingParams(temperature=0.0))
    top1 = make_request("top1", SamplingParams(temperature=2.0, top_k=1))
    wide = make_request("wide", SamplingParams(temperature=2.0))
    out = Sampler({EOS})(row.expand(3, -1).clone(), [greedy, top1, wide])
    assert out.token_ids[0] == out.token_ids[1] == int(row.argmax())


def run_steps(sampler: Sampler, target: Request, others: list[Request], logits: list[torch.Tensor],
              position: int) -> list[int]:
    """Sample `target` for several steps with `others` around it in the batch; returns its tokens."""
    tokens = []
    for step_logits in logits:
        batch = others[:position] + [target] + others[position:]
        rows = torch.randn(len(batch), VOCAB)
        rows[position] = step_logits
        tokens.append(sampler(rows, batch).token_ids[position])
    return tokens


def test_seeded_request_gives_the_same_tokens_in_any_batch():
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(VOCAB, generator=gen) for _ in range(8)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = run_steps(Sampler({EOS}), make_request("s", params), [], logits, 0)
    crowd = [make_request(f"o{i}", SamplingParams(temperature=1.0, seed=i if i % 2 else None))
             for i in range(6)]
    in_crowd = run_steps(Sampler({EOS}), make_request("s", params), crowd, logits, 3)
    other_seed = run_steps(Sampler({EOS}), make_request("s", SamplingParams(temperature=1.0, seed=99)),
                           crowd[:2], logits, 1)
    assert alone == in_crowd
    assert other_seed != alone


def test_free_restarts_a_seeded_request():
    row = torch.zeros(1, VOCAB)
    sampler = Sampler({EOS})
    req = make_request("s", SamplingParams(temperature=1.0, seed=7))
    first = [sampler(row, [req]).token_ids[0] for _ in range(6)]
    sampler.free("s")
    again = [sampler(row, [req]).token_ids[0] for _ in range(6)]
    assert first == again


def test_repetition_penalty_scales_only_seen_tokens_hf_style():
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 4] = 2.0, -1.0, 3.0
    req = make_request("r", SamplingParams(repetition_penalty=2.0), prompt=[1, 5], output=[2])
    out = apply_penalties(logits, [req])
    expected = logits.clone()
    expected[0, 1], expected[0, 2], expected[0, 5] = 1.0, -2.0, 0.0
    assert torch.equal(out, expected)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    req = make_request("r", params, prompt=[7, 7], output=[3, 3, 5])
    out = apply_penalties(logits, [req])
    expected = torch.zeros(1, VOCAB)
    expected[0, 3] = -(2 * 0.5 + 1.0)
    expected[0, 5] = -(1 * 0.5 + 1.0)
    assert torch.equal(out, expected)


def test_penalty_changes_the_greedy_choice_and_leaves_other_rows_alone():
    logits = torch.zeros(2, VOCAB)
    logits[:, 10], logits[:, 11] = 2.0, 1.5
    penalised = make_request("p", SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[10])
    plain = make_request("q", SamplingParams(temperature=0.0), output=[10])
    out = Sampler({EOS})(logits, [penalised, plain])
    assert out.token_ids == [11, 10]
    # The reported logprob is of the raw model distribution, before penalties.
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[11]), abs=1e-6)


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS], logits[:, 20], logits[:, 30] = 5.0, 4.0, 3.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[20])
    early = make_request("a", params, output=[1])
    done = make_request("b", params, output=[1, 2])
    ignoring = make_request("c", SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output=[1])
    out = Sampler({EOS})(logits, [early, done, ignoring])
    assert out.token_ids == [30, EOS, EOS]


def test_top_logprobs_hold_top_n_plus_the_chosen_token():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0] + [0.0] * (VOCAB - 4)])
    req = make_request("l", SamplingParams(temperature=1.0, top_k=1, logprobs=2))
    out = Sampler({EOS})(logits, [req])
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [0]
    assert out.top_logprobs[0] == pytest.approx({0: float(raw[0]), 1: float(raw[1])}, abs=1e-6)

    forced = torch.full((1, VOCAB), -1e9)
    forced[0, :4] = logits[0, :4]
    req2 = make_request("m", SamplingParams(temperature=0.0, repetition_penalty=100.0, logprobs=1),
                        prompt=[0, 1, 2])
    out2 = Sampler({EOS})(forced, [req2])
    assert out2.token_ids == [3]
    assert set(out2.top_logprobs[0]) == {0, 3}


def test_compute_logprobs_matches_log_softmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(5))
    targets = [3, 9, 0, 63, 17]
    chosen, tops = compute_logprobs(logits, targets, 3)
    ref = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx([float(ref[i, t]) for i, t in enumerate(targets)], abs=1e-5)
    for i, top in enumerate(tops):
        best = torch.topk(ref[i], 3).indices.tolist()
        assert set(top) == set(best) | {targets[i]}


def test_draws_follow_the_distribution():
    row = row_from_probs([0.5, 0.3, 0.15])
    rows = 4000
    requests = [make_request(f"d{i}", SamplingParams(temperature=1.0, seed=i)) for i in range(rows)]
    out = Sampler({EOS})(row.expand(rows, -1).clone(), requests)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).float() / rows
    assert counts[:3].tolist() == pytest.approx([0.5, 0.3, 0.15], abs=0.03)
    assert float(counts[3:].sum()) == pytest.approx(0.05, abs=0.02)


def test_sampled_logprobs_are_the_raw_log_softmax_whatever_the_params():
    logits = torch.randn(4, 4096, generator=torch.Generator().manual_seed(6)) * 3
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3), SamplingParams(temperature=0.0)]
    requests = [make_request(f"lp{i}", p) for i, p in enumerate(params)]
    out = Sampler({EOS})(logits, requests)
    raw = torch.log_softmax(logits.double(), -1)
    expected = [float(raw[i, t]) for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-5)
