"""Speculation for sampled requests: each draft position draws from the target distribution plain sampling
would use there (with its uniform), so seeded outputs equal those without speculation token for token;
unseeded draws follow the target distribution exactly (chi-square over many draws)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.backend.engine.request_group import StepBatch
from pagedserve.backend.engine.spec_decode import sample_step
from pagedserve.backend.structured import StructuredOutputs
from pagedserve.backend.worker.sampler import Sampler
from tests.support.engines import cpu_engine
from tests.support.speculation import (
    PROMPTS,
    all_outputs,
    assert_same,
    assert_speculated_and_all_free,
    run,
    spec,
)

SETTINGS = {"block_size": 4, "num_blocks": 128, "max_model_len": 256}


def sampled(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.5, "seed": seed, "max_tokens": 30, "ignore_eos": True, **kwargs})


PARAMS = [
    sampled(1),
    sampled(2, top_k=5, top_p=0.9, logprobs=3, temperature=0.2),
    sampled(3, min_p=0.2, temperature=1.0),
    sampled(4, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, temperature=0.2),
    sampled(5, n=3, temperature=0.2),
    SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5, logprobs=2, ignore_eos=True),
    sampled(6, min_tokens=20, ignore_eos=False),
    sampled(7, logit_bias={7: 3.0, 12: 2.0}, allowed_token_ids=list(range(3, 60))),
]


@pytest.fixture(scope="module")
def plain(tiny_llama_path):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(PARAMS))]
    return prompts, all_outputs(cpu_engine(tiny_llama_path, **SETTINGS), prompts, PARAMS)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_seeded_sampled_outputs_equal_those_without_speculation(tiny_llama_path, plain, k):
    prompts, want = plain
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=spec(k))
    got = all_outputs(engine, prompts, PARAMS)
    for rid, outs in want.items():
        assert len(got[rid]) == len(outs)
        for g, w in zip(got[rid], outs, strict=True):
            assert g.token_ids == w.token_ids, rid
            assert g.text == w.text and g.finish_reason == w.finish_reason, rid
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3), rid
            if w.logprobs is not None:
                assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in w.logprobs], rid
    assert_speculated_and_all_free(engine)


def test_grammar_mask_applies_at_every_draft_position(tiny_llama_path):
    # The prompts' n-grams propose tokens the regex forbids (rejected by the mask) and the forced
    # repetition proposes ones it allows (accepted).
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, structured_outputs={"regex": "(ab1){6}[xyz]{4}"})
              for t in (0.0, 0.8)]
    prompts = [PROMPTS[0], PROMPTS[1]]
    want = run(cpu_engine(tiny_llama_path, **SETTINGS), prompts, params)
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=spec(4))
    got = run(engine, prompts, params)
    assert_same(got, want)
    assert all(out.finish_reason == "stop" for out in got.values())
    assert_speculated_and_all_free(engine)


def test_disable_by_batch_size_turns_speculation_off_above_the_threshold(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config={**spec(3), "disable_by_batch_size": 2})
    run(engine, PROMPTS, [sampled(i) for i in range(len(PROMPTS))])
    assert engine.get_stats().spec_decode_num_drafts == 0
    run(engine, PROMPTS[:1], sampled(9))
    assert engine.get_stats().spec_decode_num_drafts > 0


def test_accepted_per_position_counts_add_up(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=spec(3))
    run(engine, PROMPTS, sampled(1, temperature=0.3))
    stats = engine.get_stats()
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == stats.spec_decode_num_accepted_tokens > 0
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and per_pos[0] <= stats.spec_decode_num_drafts


# ----------------------------------------------------------------------------- the exact distribution

CHI2_999 = {5: 20.52, 6: 22.46, 7: 24.32}  # chi-square quantile 0.999 by degrees of freedom


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the outcomes with probability > 0 (none of the others may occur)."""
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _draws(logits: torch.Tensor, drafts: list[int], params: SamplingParams, rows: int,
           eos: frozenset[int] = frozenset()) -> list[list[int]]:
    """Each of `rows` identical unseeded sequences' run through sample_step, with fixed position logits."""
    # logits: [k + 1, V]: rows 0..k-1 score the drafts, row k the token after them
    requests, scheduled = [], []
    for i in range(rows):
        request = Request(f"q{i}", [1, 2, 3], params)
        request.append_output_token_id(0)
        requests.append(request)
        scheduled.append(ScheduledRequest(request, len(drafts) + 1, 3, [], [], True, list(drafts)))
    batch = StepBatch()
    for i, request in enumerate(requests):
        batch.sample(i, None, request)
    sched = SchedulerOutput(scheduled=scheduled)
    spec_logits = {r.request_id: logits[:-1] for r in requests}
    step = sample_step(Sampler(set(eos)), StructuredOutputs(None, logits.shape[1], set()),
                       logits[-1:].expand(rows, -1).contiguous(), batch, sched, spec_logits)
    return [[token for token, _, _ in step.runs[r.request_id]] for r in requests]


def test_penalties_and_min_tokens_see_the_drafts_before_each_position():
    a, b, eos = 5, 6, 7
    logits = torch.zeros(3, 8)
    logits[0, a], logits[1, a], logits[1, b] = 3.0, 3.0, 2.5
    # A frequency penalty of 2 counts the first draft at the second position: b wins there.
    (run,) = _draws(logits, [a, a], SamplingParams(temperature=0, frequency_penalty=2.0), 1)
    assert run == [a, b]
    # eos leads everywhere; min_tokens = 3 bans it until two drafts follow the one output token.
    logits[:, eos] = 4.0
    (run,) = _draws(logits, [a, a], SamplingParams(temperature=0, min_tokens=3), 1, frozenset({eos}))
    assert run == [a, a, eos]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("draft", [0, 3, 7])  # the likeliest token, a middling one, one of probability 0
def test_point_mass_drafts_leave_the_target_distribution_exact(temperature, draft):
    torch.manual_seed(draft)
    vocab, rows = 8, 6000
    p0 = torch.tensor([0.35, 0.05, 0.15, 0.1, 0.2, 0.05, 0.1, 0.0])
    p1 = torch.tensor([0.1, 0.3, 0.0, 0.2, 0.1, 0.1, 0.15, 0.05])
    logits = torch.stack([p0.log(), p1.log(), torch.zeros(vocab)])
    params = SamplingParams(temperature=temperature, max_tokens=10)
    runs = _draws(logits, [draft, 1], params, rows)
    target0 = torch.softmax(p0.log() / temperature, dim=-1)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=vocab).float()
    stat, dof = chi_square(first, target0)
    assert stat < CHI2_999[dof], (stat, first)
    # Only a run whose first token is the draft goes on, and its second token follows the second position's p.
    assert all(len(r) == 1 for r in runs if r[0] != draft)
    second = [r[1] for r in runs if r[0] == draft]
    if target0[draft] > 0.1:
        counts = torch.bincount(torch.tensor(second), minlength=vocab).float()
        stat, dof = chi_square(counts, torch.softmax(p1.log() / temperature, dim=-1))
        assert stat < CHI2_999[dof], (stat, counts)
    assert abs(len(second) / rows - float(target0[draft])) < 0.03


def test_beam_search_runs_without_speculation_and_equals_a_plain_engines(tiny_llama_path):
    params = SamplingParams(temperature=0, beam_width=2, max_tokens=12, ignore_eos=True)
    want = run(cpu_engine(tiny_llama_path, **SETTINGS), PROMPTS[:2], params)
    engine = cpu_engine(tiny_llama_path, **SETTINGS, speculative_config=spec(3))
    assert_same(run(engine, PROMPTS[:2], params), want)
    assert engine.get_stats().spec_decode_num_drafts == 0
