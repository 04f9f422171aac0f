"""Beam search returns transformers' num_beams hypotheses, in order, also when beams are preempted."""

from __future__ import annotations

import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.engines import cpu_engine

PROMPTS = [list(range(40, 63)), list(range(100, 117)), list(range(200, 230))]


@pytest.mark.parametrize(("width", "length_penalty"), [(4, 1.0), (3, 0.5)])
def test_beams_match_transformers_num_beams(tiny_llama_path, hf_reference, width, length_penalty):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=64)
    params = SamplingParams(
        beam_width=width, n=width, max_tokens=8, ignore_eos=True, length_penalty=length_penalty
    )
    out = engine.generate([PROMPTS[0]], params)[0]
    expected = hf_reference.beams(tiny_llama_path, PROMPTS[0], width, 8, length_penalty)
    assert [c.token_ids for c in out.outputs] == expected
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert [c.text for c in out.outputs] == [engine.tokenizer.decode(t) for t in expected]
    assert engine.get_stats().kv_cache_usage == 0.0


def test_beams_ending_in_eos_match_transformers(tiny_llama_path, hf_reference):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=64)
    free_run = engine.generate(
        [PROMPTS[0]], SamplingParams(beam_width=4, n=4, max_tokens=10, ignore_eos=True)
    )[0]
    # Make a token the beams like into the eos, so some hypotheses finish early.
    eos = free_run.outputs[1].token_ids[2]
    engine.eos_token_ids.clear()
    engine.eos_token_ids.add(eos)
    out = engine.generate([PROMPTS[0]], SamplingParams(beam_width=4, n=4, max_tokens=10))[0]
    expected = hf_reference.beams(tiny_llama_path, PROMPTS[0], 4, 10, 1.0, eos_token_id=eos)
    assert [c.token_ids for c in out.outputs] == expected
    assert any(c.finish_reason == "stop" for c in out.outputs)


def test_concurrent_beam_requests_survive_preemption(tiny_llama_path):
    params = SamplingParams(beam_width=4, n=2, max_tokens=12, ignore_eos=True)
    roomy = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, params)]
    tight = cpu_engine(tiny_llama_path, block_size=4, num_blocks=24, max_num_batched_tokens=8)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(PROMPTS, params)]
    assert got == expected
    stats = tight.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_beams_that_give_back_their_blocks_are_requeued_past_a_full_waiting_queue(tiny_llama_path):
    # A tight pool stalls the beam groups: one gives its blocks back and its beams queue again. They were
    # admitted already, so max_num_waiting must not refuse them (that used to leave the group hanging).
    params = SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True)
    tight = cpu_engine(tiny_llama_path, block_size=4, num_blocks=12, max_num_seqs=3, max_num_waiting=1)
    tight.add_request("b", "The quick brown fox", params)
    tight.add_request("other", "Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tight.add_request("b2", "Hello world", SamplingParams(beam_width=2, max_tokens=12, ignore_eos=True))
    finished = {}
    for _ in range(2000):
        if not tight.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in tight.step() if o.finished})
    assert sorted(finished) == ["b", "b2", "other"]
    assert all(c.finish_reason == "length" for o in finished.values() for c in o.outputs)
    stats = tight.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_beam_search_with_min_tokens_ignores_stop_ids_outside_the_vocabulary(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path)
    params = SamplingParams(beam_width=2, max_tokens=6, min_tokens=3, stop_token_ids=[10**6])
    (out,) = engine.generate([PROMPTS[0]], params)
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [6]


def test_beam_search_that_cannot_fit_the_pool_is_refused(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=16)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(
            "wide", None, SamplingParams(beam_width=8, max_tokens=20), prompt_token_ids=PROMPTS[0]
        )
    assert info.value.field == "beam_width"
    assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
