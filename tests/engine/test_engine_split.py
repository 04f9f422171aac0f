"""The engine's two halves apart: EngineCore turns scheduled steps into token ids with no tokenizer at all;
OutputProcessor turns token ids into text, stop conditions and outputs with no model at all."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedserve.backend.core.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.backend.core.errors import ErrorKind
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler
from pagedserve.backend.engine.core import CoreStep, EngineCore
from pagedserve.backend.engine.output_processor import OutputProcessor
from pagedserve.backend.engine.spec_decode import StepSample
from pagedserve.backend.model import load_tokenizer
from pagedserve.backend.worker.model_runner import ModelRunnerOutput
from pagedserve.backend.worker.sampler import SamplerOutput
from pagedserve.testing import build_tokenizer
from tests.support.engines import cpu_engine, greedy

PROMPT_IDS = list(range(10, 23))


@pytest.fixture
def weights_only(tiny_llama_path, tmp_path):
    """The tiny Llama's config and weights without any tokenizer file."""
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_path / name, folder / name)
    return folder


def test_the_core_steps_prompt_ids_to_the_engines_tokens_without_a_tokenizer(tiny_llama_path, weights_only):
    with pytest.raises((OSError, ValueError)):  # no tokenizer to load
        load_tokenizer(weights_only)
    core = EngineCore(ModelConfig(model=str(weights_only), dtype="float32", device="cpu"),
                      CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(max_model_len=128),
                      eos_token_ids=set())
    request = Request("r", PROMPT_IDS, SamplingParams(temperature=0, max_tokens=6))
    core.add_request(request)
    steps = [core.step() for _ in range(6)]
    assert all(step.tokens == {"r": token} for step, token in zip(steps, request.output_token_ids, strict=True))
    expected = cpu_engine(tiny_llama_path, block_size=4, num_blocks=64, max_model_len=128).generate(
        [PROMPT_IDS], greedy(max_tokens=6))[0].outputs[0].token_ids
    assert request.output_token_ids == expected
    assert request.num_computed_tokens == len(PROMPT_IDS) + 5  # the newest token has no KV yet


def test_the_core_reports_an_empty_step_when_nothing_is_scheduled(weights_only):
    core = EngineCore(ModelConfig(model=str(weights_only), dtype="float32", device="cpu"),
                      CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(max_model_len=128),
                      eos_token_ids=set())
    assert core.step() is None


def _processor(tokenizer, released: list[str] | None = None) -> tuple[OutputProcessor, Scheduler]:
    """An OutputProcessor over a bare Scheduler of 32 blocks; `released` collects the ids it releases."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=32), 32)
    released = [] if released is None else released
    return OutputProcessor(tokenizer, set(), scheduler, None, released.append), scheduler


def _feed(processor: OutputProcessor, scheduler: Scheduler, token: int) -> list:
    """One step as EngineCore runs it, its forward's one row sampled as `token` (a fake model)."""
    sched = scheduler.schedule()
    rids = [s.request.request_id for s in sched.scheduled if s.sample]
    batch = processor.claim_rows(ModelRunnerOutput(rids, torch.zeros(len(rids), 8)))
    tokens = {rid: token for rid in rids}
    scheduler.update_from_output(sched, tokens)
    sampled = SamplerOutput([token] * len(rids), [-0.5] * len(rids), [None] * len(rids))
    processor.process(CoreStep(sched, batch, StepSample(sampled, {}, {}, {}), tokens))
    return processor.collect()


def test_the_output_processor_ends_a_sequence_on_a_stop_string_and_frees_its_blocks():
    tokenizer = build_tokenizer()
    text = " the quick brown fox jumps"
    answer = tokenizer.encode(text, add_special_tokens=False)
    stop = "brown"
    released: list[str] = []
    processor, scheduler = _processor(tokenizer, released)
    request = Request("r", tokenizer.encode("once upon", add_special_tokens=False),
                      SamplingParams(temperature=0, max_tokens=len(answer), stop=[stop]))
    scheduler.add_request(request)
    processor.add("r", "once upon", request, request.sampling_params)
    outputs = []
    for token in answer:
        outputs += _feed(processor, scheduler, token)
        if outputs[-1].finished:
            break
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text == text[: text.index(stop)]
    assert "".join(o.outputs[0].text_delta for o in outputs) == final.text
    assert len(final.token_ids) < len(answer)  # it ended at the stop string, not at max_tokens
    assert final.cumulative_logprob == pytest.approx(-0.5 * len(final.token_ids))
    assert request.status == RequestStatus.FINISHED_STOPPED and scheduler.get_request("r") is None
    assert scheduler.block_manager.num_free_blocks == 32 and not processor.has_unfinished()
    assert released == ["r"]  # the core's per-request state (a seeded generator) goes with it
    assert processor.prompt_tokens == request.num_prompt_tokens
    assert processor.generation_tokens == len(final.token_ids)


def test_the_output_processor_ends_a_sequence_at_max_tokens_with_length():
    tokenizer = build_tokenizer()
    processor, scheduler = _processor(tokenizer)
    request = Request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    scheduler.add_request(request)
    processor.add("r", None, request, request.sampling_params)
    finished = [out.finished for _ in range(3) for out in _feed(processor, scheduler, 40)]
    assert finished == [False, False, True]
    assert request.output_token_ids == [40, 40, 40] and scheduler.get_request("r") is None


def test_a_timeout_ends_a_waiting_request_with_a_timeout_error():
    processor, scheduler = _processor(build_tokenizer())
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=3), arrival_time=100.0)
    scheduler.add_request(request)
    processor.add("r", None, request, request.sampling_params, timeout=2.0)
    processor.end_timed_out(101.9)
    assert processor.collect() == [] and scheduler.get_request("r") is request
    processor.end_timed_out(102.0)
    (out,) = processor.collect()
    assert out.finished and out.error_kind is ErrorKind.TIMEOUT and "2 s" in out.error
    assert scheduler.get_request("r") is None and not processor.has_unfinished()
