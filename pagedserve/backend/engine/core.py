"""EngineCore: scheduled steps in, token ids out. It schedules, runs the model, samples, verifies speculation
and updates the scheduler; it knows nothing of text, request groups or stop conditions (output_processor.py).

A step is: schedule -> (encoders of the step's new images) -> forward -> sample the generation rows
(pooling rows: pooled) -> update the scheduler. Which rows a step samples, and with which grammar, is asked
of a `RowClaimer` (the output processor's request groups) once the forward has produced them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.backend.core.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.backend.engine.kv_events import make_publisher
from pagedserve.backend.engine.lora import scheduler_lora_args
from pagedserve.backend.engine.request_group import StepBatch
from pagedserve.backend.engine.spec_decode import StepSample, make_speculator, sample_step
from pagedserve.backend.structured import StructuredOutputs
from pagedserve.backend.worker.model_runner import ModelRunnerOutput
from pagedserve.backend.worker.sampler import Sampler
from pagedserve.backend.worker.tp_workers import start_runner

# Claims a forward's logits rows: which to sample (with which grammar), which children fork from a row.
RowClaimer = Callable[[ModelRunnerOutput], StepBatch]


@dataclass
class CoreStep:
    """What one executed step produced: its schedule, the rows it sampled (`batch`), and what they drew
    (`sample`, None when no row was sampled); `tokens` is each sampled request's newest token; `pooled` each
    pooling request's vector, the request finished in the scheduler (its blocks freed)."""

    sched: SchedulerOutput
    batch: StepBatch
    sample: StepSample | None
    tokens: dict[str, int]
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


class EngineCore:
    """The model runner, scheduler, sampler and speculator of one engine, stepped from one thread.

    `eos_token_ids` is what the sampler suppresses under min_tokens; `structured` masks the rows of
    structured outputs (None: the engine has none, as in a core driven without a tokenizer)."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
        eos_token_ids: set[int], structured: StructuredOutputs | None = None,
        speculative_config: SpeculativeConfig | None = None, lora_config: LoRAConfig | None = None,
    ):
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        # With tensor_parallel_size > 1 this is rank 0's runner and `workers` the other ranks' processes.
        self.runner, self.workers = start_runner(model_config, cache_config, scheduler_config, lora_config)
        self.vocab_size: int = self.runner.arch.vocab_size
        self.scheduler = Scheduler(scheduler_config, cache_config, self.runner.num_blocks,
                                   **scheduler_lora_args(lora_config, self.runner.lora))
        # A model whose image tokens attend to each other (Gemma 3) takes each image's run in one chunk.
        self.scheduler.encoder_cache.whole_runs = getattr(self.runner.model, "bidirectional_image_runs", False)
        self.sampler = Sampler(eos_token_ids)
        self.structured = structured
        self.speculator = make_speculator(speculative_config, self)
        self.kv_events = make_publisher(cache_config.kv_events, model_config.data_parallel_rank)
        if self.kv_events is not None:
            self.scheduler.block_manager.record_events()

    def add_request(self, request: Request) -> None:
        """Queue a checked request for scheduling."""
        self.scheduler.add_request(request)

    def step(self, claim: RowClaimer | None = None) -> CoreStep | None:
        """Schedule and run one step (`claim`: sample every row, no grammar); None when nothing could run."""
        sched = self.schedule()
        if not sched.scheduled:
            self.record_no_output(sched)
            return None
        return self.execute(sched, claim or self.sample_every_row)

    def schedule(self) -> SchedulerOutput:
        """Propose drafts for the running sequences (speculation), then plan the step."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def execute(self, sched: SchedulerOutput, claim: RowClaimer) -> CoreStep:
        """Run a planned step: forward, sample the claimed rows, verify drafts, update the scheduler, fork
        the children sampled from a parent's row. An encoder pass over the step's new images belongs before
        the forward; pooling rows are pooled where the generation rows are sampled."""
        runner_out = self.runner.execute(sched)
        if self.speculator is not None:
            self.speculator.observe(sched)  # a draft model runs the same step
        batch = claim(runner_out)
        logits = runner_out.sample_logits
        if batch.rows != list(range(logits.shape[0])):  # the usual case needs no copy of the [R, V] logits
            logits = logits[batch.rows]
        sample = sample_step(self.sampler, self.structured, logits, batch, sched, runner_out.spec_logits)
        tokens: dict[str, int] = {}
        if sample is not None:
            tokens = dict(zip((r.request_id for r in batch.requests), sample.sampled.token_ids, strict=True))
            if sample.num_drafts:
                self.speculator.count(sample.num_drafts, sample.num_accepted)
        self.scheduler.update_from_output(sched, tokens, None if sample is None else sample.num_accepted)
        for _, parent, child in batch.forks:
            self.scheduler.fork_request(parent.request_id, child)
            child.append_output_token_id(tokens[child.request_id])
        if runner_out.pooled:  # prefill only: done once pooled, its blocks freed at once
            self.scheduler.finish_requests(list(runner_out.pooled), RequestStatus.FINISHED_STOPPED)
        self.publish_kv_events()
        return CoreStep(sched, batch, sample, tokens, runner_out.pooled)

    def record_no_output(self, sched: SchedulerOutput) -> None:
        """Close a step that sampled nothing: none was scheduled, or it failed (its requests ended first)."""
        self.scheduler.update_from_output(sched, {})
        self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """Hand what the prefix cache gained and lost since the last call to the KV events publisher."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.block_manager.take_events())

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents); routers hear AllBlocksCleared."""
        self.scheduler.reset_prefix_cache()
        self.publish_kv_events()

    def sample_every_row(self, runner_out: ModelRunnerOutput) -> StepBatch:
        """The plain claim: each row sampled for its own request, without a grammar."""
        batch = StepBatch()
        for row, request_id in enumerate(runner_out.sample_request_ids):
            batch.sample(row, None, self.scheduler.get_request(request_id))
        return batch

    def release(self, request_id: str) -> None:
        """Drop what the sampler keeps for a request that is gone (its seeded generator)."""
        self.sampler.free(request_id)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV events publisher."""
        if self.workers is not None:
            self.workers.stop()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def failure(self) -> str | None:
        """Why no further step can run (a tensor-parallel rank is gone); None while one can."""
        return None if self.workers is None else self.workers.group.failure
