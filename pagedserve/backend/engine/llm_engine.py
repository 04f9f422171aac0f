"""The offline LLMEngine: validate and queue requests, step them, return their outputs. It composes an
EngineCore (schedule, run, sample: token ids) and an OutputProcessor (request groups, text, stop conditions,
timeouts, outputs), and holds the LoRA adapters' registry.

Not thread-safe: one thread drives add_request / abort_request / step.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pagedserve.backend.core.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.outputs import EngineStats, RequestOutput
from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.backend.engine.core import EngineCore
from pagedserve.backend.engine.engine_args import engine_args
from pagedserve.backend.engine.input_processing import (
    check_beams_fit,
    check_params,
    check_priority_policy,
    resolve_logits_params,
    resolve_prompt,
    truncate_prompt,
)
from pagedserve.backend.engine.lora import LoRARegistry
from pagedserve.backend.engine.multimodal import ImageProcessor, ProcessedPrompt, prompt_with_images
from pagedserve.backend.engine.output_processor import OutputProcessor
from pagedserve.backend.engine.pooling import PoolingSupport, run_pooling
from pagedserve.backend.model import ModelArchConfig, load_eos_token_ids, load_tokenizer
from pagedserve.backend.structured import StructuredOutputs
from pagedserve.backend.worker.model_runner import ModelRunner
from pagedserve.backend.worker.sampler import Sampler

logger = logging.getLogger(__name__)


@functools.cache
def _unfreeze_at_exit() -> None:
    """Hand frozen objects back to the collector at exit, so interpreter shutdown frees them as usual."""
    atexit.register(gc.unfreeze)


class LLMEngine:
    """Paged-KV-cache generation over a Llama-family model; `step()` runs one scheduled forward."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
        speculative_config: SpeculativeConfig | None = None, lora_config: LoRAConfig | None = None,
        lora_modules: dict[str, str] | None = None,
    ):
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        arch = ModelArchConfig.from_pretrained(model_config.model)  # a missing or unsupported model fails first
        self.tokenizer = load_tokenizer(model_config.model)
        # A vision-language model's processor (engine/multimodal.py); None for a text-only model.
        image_token_id = getattr(arch, "image_token_id", None)
        self.image_processor = None if image_token_id is None else ImageProcessor(
            model_config.model, image_token_id, scheduler_config.image_limit)
        self.eos_token_ids: set[int] = load_eos_token_ids(model_config.model, arch, self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, arch.vocab_size, self.eos_token_ids)
        self.core = EngineCore(model_config, cache_config, scheduler_config, self.eos_token_ids, self.structured,
                               speculative_config, lora_config)
        self.vocab_size = self.core.vocab_size
        self.pooling = PoolingSupport(model_config.runner, model_config.model, self.runner.pooler,
                                      getattr(arch, "is_encoder", False), scheduler_config)
        self.lora = LoRARegistry(lora_config, self.runner.lora)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler, self.structured,
                                      self.core.release)
        self._id_counter = itertools.count()
        self.lora.load_modules(lora_modules)

    @classmethod
    def from_pretrained(cls, model: str, **kwargs: Any) -> LLMEngine:
        """Load a Hugging Face model folder; kwargs: the configs' fields, `speculative_config` (dict or JSON),
        `lora_modules` (adapter name -> PEFT folder, loaded at start)."""
        args = engine_args(model, kwargs)
        engine = cls(args.model_config, args.cache_config, args.scheduler_config, args.speculative_config,
                     args.lora_config, args.lora_modules)
        # What start-up made (weights' modules, tokenizer, block pool) lives as long as the engine: out of
        # the garbage collector's full passes, which otherwise rescan it every few hundred steps.
        gc.collect()
        gc.freeze()
        _unfreeze_at_exit()
        return engine

    @property
    def runner(self) -> ModelRunner:
        """The model runner (rank 0's under tensor parallelism)."""
        return self.core.runner

    @property
    def workers(self) -> Any:
        """The other tensor-parallel ranks' processes; None on one device."""
        return self.core.workers

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (and through it the block manager)."""
        return self.core.scheduler

    @property
    def sampler(self) -> Sampler:
        """The sampler of the engine core."""
        return self.core.sampler

    @property
    def speculator(self) -> Any:
        """The draft proposer; None without speculative decoding."""
        return self.core.speculator

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
        timeout: float | None = None,
        images: Sequence[Any] | ProcessedPrompt | None = None,
    ) -> None:
        """Validate and queue a request; bad input raises InvalidRequestError naming the field.

        `add_special_tokens=False` tokenizes a text prompt without the tokenizer's own special tokens (a BOS):
        for a prompt rendered from a chat template, which has them already (as vLLM's chat API does).
        `priority` orders it under the "priority" scheduling policy (lower first); a `timeout` in seconds
        from `arrival_time` (time.monotonic(), default now) ends it with a TIMEOUT error once it passes.
        `images` (image file bytes or PIL images, or `image_processor.process_async`'s result) go with a text
        prompt that holds the model's placeholders, one an image."""
        self._check_request_id(request_id)
        self.pooling.check_task("generate")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}", "sampling_parameters"
            )
        token_ids, mm_inputs = self._prompt(prompt, prompt_token_ids, add_special_tokens, images, params)
        check_params(params, self.scheduler_config.max_num_seqs)
        self.lora.resolve(params)
        _check_timeout(timeout)
        check_priority_policy(priority, self.scheduler_config.scheduling_policy)
        token_ids = truncate_prompt(token_ids, params, self.scheduler_config.max_model_len)
        resolve_logits_params(self.tokenizer, self.vocab_size, params)
        # Compiled before the request takes any KV: a spec that does not compile is refused here.
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        salt = None
        if params.prompt_logprobs is not None:
            # Prompt logprobs need logits at every prompt position, so such a request never hits the cache.
            salt = f"prompt-logprobs-{uuid.uuid4().hex}"
        request = Request(
            request_id, token_ids, params, arrival_time=arrival_time, cache_salt=salt, group_id=request_id,
            priority=priority, mm_inputs=mm_inputs,
        )
        self.core.add_request(request)
        if params.beam_width > 1:
            try:
                check_beams_fit(request, self.cache_config, self.runner.num_blocks)
            except InvalidRequestError:
                self.scheduler.abort(request_id)
                raise
        self.output.add(request_id, prompt, request, params, grammar, timeout)

    def add_pooling_request(
        self, request_id: str, prompt: str | None, params: PoolingParams | None = None,
        prompt_token_ids: list[int] | None = None, text_pair: str | None = None, arrival_time: float | None = None,
        priority: int = 0, timeout: float | None = None,
    ) -> None:
        """Validate and queue a pooling request (prefill only): a text, token ids, or a text pair (`prompt`,
        `text_pair`) for a cross-encoder; its RequestOutput's `pooled` is the answer. Refused naming the field."""
        self._check_request_id(request_id)
        params = PoolingParams(task=self.pooling.default_task) if params is None else params
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"params must be a PoolingParams, got {type(params).__name__}", "pooling_params")
        _check_timeout(timeout)
        check_priority_policy(priority, self.scheduler_config.scheduling_policy)
        request = self.pooling.make_request(request_id, self.tokenizer, self.vocab_size, prompt, params,
                                            prompt_token_ids, text_pair, arrival_time=arrival_time, priority=priority)
        self.core.add_request(request)
        self.output.add_pooling(request_id, prompt, request, self.pooling, timeout)

    def encode(self, inputs: Sequence[str | list[int] | tuple[str, str]],
               params: PoolingParams | None = None) -> list[RequestOutput]:
        """Pool inputs (texts, token-id lists, or (text, text_pair) pairs) to completion; outputs in order."""
        return run_pooling(self, inputs, params)

    def _prompt(self, prompt: str | None, prompt_token_ids: list[int] | None, add_special_tokens: bool,
                images: Sequence[Any] | ProcessedPrompt | None, params: SamplingParams) -> tuple[list[int], tuple]:
        """The prompt's token ids and its images (core ImageInputs, placeholders expanded in the ids)."""
        if images is None:
            return resolve_prompt(self.tokenizer, self.vocab_size, prompt, prompt_token_ids, add_special_tokens), ()
        processed = prompt_with_images(self.image_processor, prompt, images, add_special_tokens, params,
                                       self.scheduler_config, self.core)
        return processed.token_ids, processed.images

    def _check_request_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        if self.output.in_use(request_id):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")

    def abort_request(self, request_id: str) -> None:
        """Abort a user request (all its sequences); its final output comes from the next step()."""
        self.output.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache); KV events announce it."""
        self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device); the engine runs no step after this."""
        self.core.shutdown()

    def failure(self) -> str | None:
        """Why this engine can run no further step (a tensor-parallel rank is gone); None while it can."""
        return self.core.failure()

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running, or has a final output not yet returned."""
        return self.output.has_unfinished()

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter in folder `path` as `name`; InvalidRequestError naming it if it cannot serve."""
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name`; refused (InvalidRequestError) while a request uses it, or if unknown."""
        self.lora.remove(name, self.scheduler.requests.values())

    def list_loras(self) -> dict[str, str]:
        """Loaded adapters, name -> path, in load order."""
        return self.lora.list()

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward; one output per user request that got tokens or finished."""
        self.output.end_timed_out(time.monotonic())
        sched = self.core.schedule()
        if sched.scheduled:
            self._run(sched)
        else:
            self.core.record_no_output(sched)
            if self.scheduler.num_waiting:
                self.output.release_stalled_beams()
        return self.output.collect()

    def _run(self, sched: SchedulerOutput) -> None:
        """Execute a scheduled step and record its tokens; a failure ends the step's requests with an error."""
        try:
            self.output.process(self.core.execute(sched, self.output.claim_rows))
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the engine down
            logger.exception("step failed; ending its %d requests with an error", len(sched.scheduled))
            self.output.fail_step(sched, f"{type(exc).__name__}: {exc}")
            self.core.record_no_output(sched)

    # ------------------------------------------------------------------ offline helpers

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (texts or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} params for {len(prompts)} prompts", "params")

        def submit(prompt: str | list[int], p: SamplingParams) -> Callable[[str], object]:
            if isinstance(prompt, str):
                return lambda rid: self.add_request(rid, prompt, p)
            return lambda rid: self.add_request(rid, None, p, prompt_token_ids=list(prompt))

        return self.run_all([submit(prompt, p) for prompt, p in zip(prompts, params, strict=True)], "generate")

    def run_all(self, submits: Sequence[Callable[[str], object]], prefix: str) -> list[RequestOutput]:
        """Queue one request per `submits` entry (each called with its new id), all or nothing: a refused one
        withdraws those queued before it; then step until each has its final output, returned in order."""
        ids: list[str] = []
        try:
            for submit in submits:
                rid = f"{prefix}-{next(self._id_counter)}"
                submit(rid)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.abort_request(rid)
            self.step()
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            final.update((out.request_id, out) for out in self.step() if out.finished)
        return [final[rid] for rid in ids]

    def stream(
        self, prompt: str, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Add one request and yield its outputs step by step; closing the iterator aborts it."""
        rid = request_id or f"stream-{next(self._id_counter)}"
        self.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.abort_request(rid)

    def get_stats(self) -> EngineStats:
        """Current gauges and running totals for metrics."""
        sch = self.scheduler
        return EngineStats(
            num_running=sch.num_running,
            num_waiting=sch.num_waiting,
            kv_cache_usage=sch.kv_cache_usage(),
            prefix_cache_queries=sch.prefix_cache_queries,
            prefix_cache_hits=sch.prefix_cache_hits,
            mm_cache_queries=sch.encoder_cache.num_queries,
            mm_cache_hits=sch.encoder_cache.num_hits,
            num_preemptions=sch.num_preemptions,
            prompt_tokens=self.output.prompt_tokens,
            generation_tokens=self.output.generation_tokens,
            num_blocks=self.runner.num_blocks,
            num_free_blocks=sch.block_manager.num_free_blocks,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **self.lora.stats(sch),
        )


def _check_timeout(timeout: object) -> None:
    """A request's timeout is None (none) or a finite number of seconds > 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidRequestError(f"timeout must be a number of seconds > 0, got {timeout!r}", "timeout")
