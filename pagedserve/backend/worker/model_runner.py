"""Turns a SchedulerOutput into one batched forward over the paged KV cache and returns the logits it needs."""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field

import torch

import pagedserve
from pagedserve import kernels
from pagedserve.backend.core.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.backend.model import LlamaForCausalLM, ModelArchConfig, load_model, resolve_dtype
from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.cpu_linear import can_prepack, prepack_linears
from pagedserve.backend.model.kv_calibration import calculate_kv_scales, calibration_ids
from pagedserve.backend.model.loader import load_tokenizer
from pagedserve.backend.worker.lora import LoRAManager, LoRAShard
from pagedserve.backend.worker.multimodal import EncoderRunner
from pagedserve.backend.worker.parallel import StepPlan, TensorParallel
from pagedserve.backend.worker.pooling import PoolSpan, StepPooler, pool_spans, token_type_ids
from pagedserve.kernels import kv8

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default budget on the CPU, where free memory says little about what is safe
# bf16 results are bit-identical to F.linear; fp32 ones differ at rounding level (see cpu_linear).
_PREPACK_DTYPES = {torch.bfloat16, torch.float32}


@dataclass
class ModelRunnerOutput:
    """Logits of one step: one fp32 row per sampling request, plus prompt rows for prompt_logprobs.

    `prompt_logits[request_id] = (p, logits[k, V])`: row i scores prompt token p + 1 + i.
    `spec_logits[request_id] = logits[k, V]`: row i scores its draft token i (its sample row the token after).
    """

    sample_request_ids: list[str]
    sample_logits: torch.Tensor  # [R, V] fp32
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # a finished pooling request's fp32 vector


def resolve_device(device: str) -> torch.device:
    """'auto' is CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _set_cpu_threads(cpu_threads: int | None) -> None:
    """Apply the configured intra-op thread count; one thread when OpenMP workers would spin (see pagedserve)."""
    if cpu_threads is None and pagedserve.OPENMP_MAY_SPIN and torch.get_num_threads() > 1:
        logger.warning(
            "torch was imported before pagedserve without OMP_WAIT_POLICY set; using one CPU thread "
            "(set OMP_WAIT_POLICY=PASSIVE or import pagedserve first to use more)"
        )
        cpu_threads = 1
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_THRESHOLD_BYTES = 1 << 30


def _keep_large_allocations_mapped() -> None:
    """Serve large CPU tensors from glibc's heap instead of fresh mmaps, and keep freed memory mapped.

    glibc maps every allocation over 32 MiB anew (a decode step's fp32 logits are that large) and the kernel
    zero-fills its pages on first touch, every step (docs/benchmarks.md, "Page faults"). A CPU engine
    reuses the same sizes every step, so the memory is better kept. No-op where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _MALLOC_THRESHOLD_BYTES)


class ModelRunner:
    """Owns the model and its per-layer KV cache; `execute` runs one scheduled step."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None = None, tp: TensorParallel | None = None,
    ):
        self.tp = tp  # this rank's tensor-parallel group; None on one device
        self.device = resolve_device(model_config.device) if tp is None else tp.device
        if self.device.type == "cpu":
            _set_cpu_threads(model_config.cpu_threads)
            _keep_large_allocations_mapped()
        self.arch = ModelArchConfig.from_pretrained(model_config.model)
        self.dtype = resolve_dtype(model_config.dtype, self.arch)
        if (self.device.type == "cpu" and model_config.dtype == "auto" and self.dtype != torch.float32
                and not can_prepack(self.dtype)):
            # Without AVX-512 (or AVX-NE-CONVERT) oneDNN has no fast half-precision GEMM: fp32 is faster
            # (`python bench/kernel_bench.py linear`).
            logger.warning("this CPU has no fast %s matmul; dtype 'auto' runs the %s checkpoint in float32 "
                           "(set dtype to keep %s)", self.dtype, self.dtype, self.dtype)
            self.dtype = torch.float32
        self.block_size = cache_config.block_size
        # No position reaches max_model_len; the rotary table spans it (LongRoPE picks its factors by it).
        max_position = scheduler_config.max_model_len
        torch.manual_seed(model_config.seed)
        if tp is None:
            self.model: LlamaForCausalLM = load_model(model_config.model, self.dtype, self.device, max_position,
                                                      model_config.quantization)
        else:
            self.model = tp.load_model(model_config.model, self.dtype, max_position)
            self.arch = self.model.config  # this rank's heads: its KV cache holds only theirs
        # An encoder keeps no K/V (its blocks are bookkeeping, its caches empty) and torch's linears: oneDNN's
        # prepacked weights were no faster on its GEMMs at bge-small's shapes, several times slower at small ones.
        self.keeps_kv = getattr(self.model, "uses_kv_cache", True)
        if self.device.type == "cpu" and self.dtype in _PREPACK_DTYPES and self.keeps_kv:
            logger.info("prepacked %d linear layers for oneDNN", prepack_linears(self.model))
        self.pooler = StepPooler.for_model(self.model, model_config.model)
        self.lora: LoRAManager | None = None
        if lora_config is not None and lora_config.enable_lora:
            # Under tensor parallelism adapters are checked against the whole model, each rank keeping its shard.
            shard = None if tp is None else LoRAShard(ModelArchConfig.from_pretrained(model_config.model), tp.rank,
                                                      tp.world_size)
            self.lora = LoRAManager(self.model, self.arch, lora_config, self.dtype, self.device, shard)
        # Under tensor parallelism each rank holds its own heads' cache in this dtype (an encoder's stays empty).
        self.kv_cache_dtype = kv8.cache_dtype(cache_config.kv_cache_dtype, self.dtype)
        self._check_kv_cache_dtype(cache_config.kv_cache_dtype)
        if cache_config.calculate_kv_scales and self.keeps_kv and kv8.is_fp8(torch.empty((), dtype=self.kv_cache_dtype)):
            self._calculate_kv_scales(model_config.model, max_position)
        self.num_blocks = self._num_blocks(cache_config, scheduler_config)
        if tp is not None:
            self.num_blocks = tp.agree_num_blocks(self.num_blocks)
        self._allocate_kv_caches()

    def _allocate_kv_caches(self) -> None:
        """Every layer's K and V cache tensors, [num_blocks, block_size, Hkv, D] in the KV cache dtype."""
        shape = (self.num_blocks, self.block_size, self.arch.num_kv_heads if self.keeps_kv else 0, self.arch.head_dim)
        # Zeroed, not empty: attention reads whole blocks and masks the tail, and 0 * NaN would leak.
        self.key_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(self.arch.num_layers)
        ]
        self.value_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(self.arch.num_layers)
        ]
        self.kv_caches = list(zip(self.key_caches, self.value_caches, strict=True))
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB) on %s in %s",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_bytes / 2**20,
            self.device,
            self.kv_cache_dtype,
        )

    def _check_kv_cache_dtype(self, name: str) -> None:
        """Refuse at start an 8-bit cache this device's kernels cannot write or read: one tiny write and
        attention through the kernel entries, as every step runs them."""
        if not kv8.is_fp8(torch.empty((), dtype=self.kv_cache_dtype)) or not self.keeps_kv:
            return
        heads, head_dim = self.arch.num_kv_heads, self.arch.head_dim
        caches = [torch.zeros((1, self.block_size, heads, head_dim), dtype=self.kv_cache_dtype, device=self.device)
                  for _ in range(2)]
        kv = torch.ones((1, heads, head_dim), dtype=self.dtype, device=self.device)
        one = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        try:
            kernels.reshape_and_cache(kv, kv, *caches, one[:1].long())
            kernels.paged_attention(kv, *caches, one[None, :1], one, one[1:], 1.0, 1, 1)
        except (RuntimeError, NotImplementedError, TypeError) as error:
            raise ConfigError(f"kv_cache_dtype {name!r} cannot be read on {self.device} with {self.dtype} "
                              f"activations: {error}", "kv_cache_dtype") from error

    def _calculate_kv_scales(self, model_path: str, max_position: int) -> None:
        """Each layer's K/V scales from one forward over the calibration text (every rank together, before
        its first collective of the block count), where the checkpoint gave none; fixed from then on."""
        token_ids = calibration_ids(load_tokenizer(model_path), max_position)
        scales = calculate_kv_scales(self.model, self.arch, token_ids, self.dtype, self.device, self.block_size)
        if scales:
            k, v = ([pair[i] for pair in scales.values()] for i in range(2))
            logger.info("KV cache scales computed over %d tokens for %d layers: k %.3g-%.3g, v %.3g-%.3g",
                        len(token_ids), len(scales), min(k), max(k), min(v), max(v))

    @functools.cached_property
    def encoder(self) -> EncoderRunner | None:
        """A vision-language model's encoder pass and embedding cache (worker/multimodal.py); None otherwise."""
        return EncoderRunner(self.model) if hasattr(self.model, "encode_images") else None

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.arch.num_layers * self.block_size * self.arch.num_kv_heads * self.arch.head_dim * elem

    def _num_blocks(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> int:
        """Blocks that fit the budget: explicit count, explicit bytes, or a share of the device's memory."""
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        if not self.keeps_kv:  # enough for every sequence at its longest
            return scheduler_config.max_num_seqs * -(-scheduler_config.max_model_len // self.block_size)
        if cache_config.kv_cache_memory_bytes is not None:
            budget = cache_config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_budget(cache_config.gpu_memory_utilization, scheduler_config)
        else:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds no block of {self.block_bytes} bytes; "
                "raise kv_cache_memory_bytes or gpu_memory_utilization"
            )
        return int(num_blocks)

    def _cuda_budget(self, utilization: float, scheduler_config: SchedulerConfig) -> int:
        """utilization * total memory, less what the weights and a full-size profiling step take."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_step(scheduler_config)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory used outside this process's allocator (other processes, CUDA context) also counts.
        other = total - free - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return int(total * utilization - peak - max(other, 0))

    def _profile_step(self, scheduler_config: SchedulerConfig) -> None:
        """One forward of max_num_batched_tokens tokens, so the budget leaves room for activations."""
        num_tokens = min(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        shape = (num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        caches = [
            (torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),) * 2
            for _ in range(self.arch.num_layers)
        ]
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions,
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            max_seqlen_q=num_tokens,
            max_seqlen_k=num_tokens,
        )
        with torch.inference_mode():
            hidden = self.model(torch.zeros_like(positions), positions, caches, meta)
            rows = min(scheduler_config.max_num_seqs, num_tokens)
            self.model.compute_logits(hidden[:rows])

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply block copies, run one forward over every scheduled token, return the needed logits."""
        with torch.inference_mode():
            kernels.copy_blocks(self.key_caches, self.value_caches, scheduler_output.block_copies)
            scheduled = scheduler_output.scheduled
            if self.lora is not None:  # rows of one adapter together: each kernel call takes them as a slice
                scheduled = self.lora.prepare(scheduled)
            batch = self._prepare(scheduled)
            embeds = None
            if self.encoder is not None:  # the step's new images encoded; their rows replace the placeholders'
                self.encoder.encode(scheduler_output)
                embeds = self.encoder.inputs_embeds(scheduled, batch.input_ids)
                batch.positions = self.encoder.positions(scheduled, batch.positions)  # M-RoPE's, for Qwen2-VL
                batch.meta.bidirectional_ranges = self.encoder.bidirectional_ranges(  # Gemma 3's image runs
                    scheduled, batch.input_ids.shape[0], self.device)
            if self.tp is not None:
                self.tp.broadcast(StepPlan.of(scheduler_output.block_copies, batch.input_ids, batch.positions,
                                              batch.meta, batch.logit_rows,
                                              None if self.lora is None else self.lora.plan()))
            extra = {} if batch.token_type_ids is None else {"token_type_ids": batch.token_type_ids}
            if embeds is not None:
                extra["inputs_embeds"] = embeds
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, **extra)
            logits = self.model.compute_logits(hidden[batch.logit_rows])
            pooled = self.pooler.pool(hidden, batch.pool_spans)
        num_sample = len(batch.sample_request_ids)
        prompt_logits = {rid: (start, logits[a:b]) for rid, (start, a, b) in batch.prompt_row_ranges.items()}
        spec_logits = {rid: logits[a:b] for rid, (a, b) in batch.spec_row_ranges.items()}
        return ModelRunnerOutput(batch.sample_request_ids, logits[:num_sample], prompt_logits, spec_logits, pooled)

    def _prepare(self, scheduled: list[ScheduledRequest]) -> _Batch:
        """Flatten the scheduled chunks into input ids, positions and attention metadata."""
        input_ids: list[int] = []
        q_lens, ctx_lens, tables = [], [], []
        sample_ids, sample_rows = [], []
        prompt_spans: list[tuple[str, int, int, int]] = []  # (request_id, first_pos, first_row, n_rows)
        spec_spans: list[tuple[str, int, int]] = []  # (request_id, first_row, n_drafts)
        offset = 0
        for item in scheduled:
            req, start, count = item.request, item.num_computed_tokens, item.num_scheduled_tokens
            num_spec = len(item.spec_token_ids)
            input_ids += req.all_token_ids[start : start + count - num_spec]
            if num_spec:
                input_ids += item.spec_token_ids
                spec_spans.append((req.request_id, offset, num_spec))
            q_lens.append(count)
            ctx_lens.append(start + count)
            tables.append(item.block_ids)
            if item.sample and req.pooling_params is None:  # a pooling request's rows are pooled instead
                sample_ids.append(req.request_id)
                sample_rows.append(offset + count - 1)
            if req.sampling_params.prompt_logprobs is not None:
                # Rows at positions p < num_prompt - 1 score the prompt token at p + 1.
                end = min(start + count, req.num_prompt_tokens - 1)
                if end > start:
                    prompt_spans.append((req.request_id, start, offset, end - start))
            offset += count
        dev = self.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        ctx_lens_t = torch.tensor(ctx_lens, dtype=torch.int64)
        cu_seqlens = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=cu_seqlens[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t, output_size=offset)
        positions = torch.arange(offset) - cu_seqlens[seq_idx] + (ctx_lens_t - q_lens_t)[seq_idx]
        slots = (
            block_tables[seq_idx, positions // self.block_size].long() * self.block_size
            + positions % self.block_size
        )
        logit_rows, prompt_row_ranges, spec_row_ranges = _logit_rows(sample_rows, prompt_spans, spec_spans)
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            cu_seqlens_q=cu_seqlens.to(device=dev, dtype=torch.int32, non_blocking=True),
            seq_lens=ctx_lens_t.to(device=dev, dtype=torch.int32, non_blocking=True),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(ctx_lens),
        )
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            meta=meta,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64).to(dev, non_blocking=True),
            sample_request_ids=sample_ids,
            prompt_row_ranges=prompt_row_ranges,
            spec_row_ranges=spec_row_ranges,
            pool_spans=pool_spans(scheduled),
            token_type_ids=self._token_types(scheduled, offset),
        )

    def _token_types(self, scheduled: list[ScheduledRequest], num_tokens: int) -> torch.Tensor | None:
        """The step's token type ids, for a model that has token types and a text pair in the step."""
        takes_types = getattr(self.arch, "type_vocab_size", 0) > 1
        types = token_type_ids(scheduled, num_tokens) if takes_types else None
        return None if types is None else types.to(self.device, non_blocking=True)


def _logit_rows(
    sample_rows: list[int], prompt_spans: list[tuple[str, int, int, int]], spec_spans: list[tuple[str, int, int]]
) -> tuple[list[int], dict[str, tuple[int, int, int]], dict[str, tuple[int, int]]]:
    """Hidden-state rows to compute logits for: sample rows first, then prompt-logprob and draft rows."""
    logit_rows = list(sample_rows)
    prompt_row_ranges = {}
    for rid, first_pos, first_row, n_rows in prompt_spans:
        prompt_row_ranges[rid] = (first_pos, len(logit_rows), len(logit_rows) + n_rows)
        logit_rows += range(first_row, first_row + n_rows)
    spec_row_ranges = {}
    for rid, first_row, n_rows in spec_spans:
        spec_row_ranges[rid] = (len(logit_rows), len(logit_rows) + n_rows)
        logit_rows += range(first_row, first_row + n_rows)
    return logit_rows, prompt_row_ranges, spec_row_ranges


@dataclass
class _Batch:
    """The flat device tensors of one step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [R + prompt rows]
    sample_request_ids: list[str]
    prompt_row_ranges: dict[str, tuple[int, int, int]]  # request_id -> (first_pos, row_start, row_end)
    spec_row_ranges: dict[str, tuple[int, int]]  # request_id -> (row_start, row_end)
    pool_spans: list[PoolSpan] = field(default_factory=list)
    token_type_ids: torch.Tensor | None = None  # [T], only for an encoder with a text pair in the step
