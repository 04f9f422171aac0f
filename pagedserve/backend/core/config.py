"""Validated configuration dataclasses for the cache, the scheduler and the model. Each field made with `param`
is an engine parameter: its type, default, help and choices are the one source `core/parameters.py` lists for
from_pretrained's options, the llm model's config.pbtxt parameters and `pagedserve serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pagedserve.backend.core.errors import ConfigError, json_object
from pagedserve.backend.core.kv_events import KVEventsConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
QUANTIZATIONS = ("none", "int8", "int4")  # on-the-fly weight quantization (pagedserve/backend/model/quantized.py)
# What an engine serves (vLLM's --runner): generation, pooling (embeddings, scores, classes), or on a decoder both.
RUNNERS = ("auto", "generate", "pooling", "all")
# The KV cache tensors' dtype (vLLM's values): the model's, or 8-bit floats (fp8 is e4m3), half the bytes a block.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
MAX_BLOCK_SIZE = 256
MAX_TENSOR_PARALLEL_SIZE = 64


def param(default: object, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field that is an engine parameter, with the help text and choices its flag and docs show."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ConfigError unless `value` is an int (not bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__}", name)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be {bound}, got {value}", name)


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache layout; the number of blocks comes from a memory budget unless fixed."""

    block_size: int = param(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = param(None, "fix the number of KV blocks (default: from the memory budget)")
    kv_cache_memory_bytes: int | None = param(None, "KV-cache budget in bytes (default: 1 GiB on the CPU)")
    gpu_memory_utilization: float = param(0.9, "fraction of free GPU memory for the KV cache when no budget is given")
    enable_prefix_caching: bool = param(True, "share the KV of identical full prompt blocks")
    kv_cache_dtype: str = param("auto", "KV cache dtype: auto (the model's) or 8-bit floats, twice the blocks in "
                                "the same memory (fp8 = fp8_e4m3; per-layer k/v scales from the checkpoint, "
                                "else 1.0 or computed: calculate_kv_scales)", KV_CACHE_DTYPES)
    calculate_kv_scales: bool = param(False, "with an 8-bit KV cache, per-layer k/v scales computed once at start "
                                      "from a calibration text (largest |K| / 200, |V| / 100, vLLM's rule) where "
                                      "the checkpoint has none, instead of 1.0")
    kv_events_config: dict | None = param(
        None, 'publish KV cache events to routers, vLLM\'s JSON: {"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"} (core/kv_events.py)')

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {self.block_size}",
                "block_size",
            )
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {util!r}", "gpu_memory_utilization"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}",
                "enable_prefix_caching",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                              "kv_cache_dtype")
        if not isinstance(self.calculate_kv_scales, bool):
            raise ConfigError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}",
                              "calculate_kv_scales")
        KVEventsConfig.from_dict(self.kv_events_config)

    @property
    def kv_events(self) -> KVEventsConfig:
        """kv_events_config, checked and with vLLM's defaults filled in."""
        return KVEventsConfig.from_dict(self.kv_events_config)


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step limits: sequences, tokens, context length and the waiting queue's depth; and the order
    waiting requests are admitted in: "fcfs" (arrival), or "priority" (vLLM's: lower `priority` first,
    arrival within a level, and a waiting request may preempt running ones of a lower priority)."""

    max_num_seqs: int = param(256, "sequences in one step (a request of n > 1 counts n)")
    max_num_batched_tokens: int = param(2048, "token budget of one step (prefill chunks + decodes)")
    max_model_len: int = param(2048, "longest prompt + output (from_pretrained: the model's max_position_embeddings)")
    max_num_waiting: int = param(4096, "requests that may wait beyond the free running slots before UNAVAILABLE")
    scheduling_policy: str = param("fcfs", "fcfs: arrival order; priority: each request's priority, lower first",
                                   SCHEDULING_POLICIES)
    max_num_encoder_input_tokens: int | None = param(
        None, "encoder budget of one step: image embedding rows encoded (default: max_num_batched_tokens; a "
        "step's first image is encoded even past it)")
    encoder_cache_size: int | None = param(
        None, "image embedding rows kept between steps, for images not yet prefilled and repeated ones "
        "(default: 4 x the encoder budget, at least 8192)")
    limit_mm_per_prompt: dict | None = param(
        None, 'at most N images one prompt may carry, vLLM\'s JSON: {"image": N} (default: no limit of the '
        "engine's; the llm model's image input takes at most 16); more are refused naming images")

    @property
    def image_limit(self) -> int | None:
        """The images one prompt may carry (limit_mm_per_prompt); None: no limit."""
        return None if self.limit_mm_per_prompt is None else self.limit_mm_per_prompt.get("image")

    @property
    def encoder_budget(self) -> int:
        """Image embedding rows one step encodes."""
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def encoder_cache_rows(self) -> int:
        """Image embedding rows the encoder cache holds."""
        return self.encoder_cache_size or max(4 * self.encoder_budget, 8192)

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_num_waiting", self.max_num_waiting, 1)
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.limit_mm_per_prompt is not None:  # a config.pbtxt parameter or a flag gives it as JSON text
            self.limit_mm_per_prompt = json_object(self.limit_mm_per_prompt, "limit_mm_per_prompt", ConfigError)
            for modality, count in self.limit_mm_per_prompt.items():
                if modality != "image":
                    raise ConfigError(f"limit_mm_per_prompt: unknown modality {modality!r}; pagedserve takes "
                                      "image", "limit_mm_per_prompt")
                _check_int("limit_mm_per_prompt", count, 0)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
                "scheduling_policy",
            )


@dataclass(slots=True)
class ModelConfig:
    """Which model to load, in which dtype, on which device, with its projections quantized or not."""

    model: str  # from_pretrained's first argument and the llm model's `model` parameter, not an option
    dtype: str = param("auto", "the weights' and activations' dtype (auto: the checkpoint's)", _DTYPES)
    quantization: str = param("none", "quantize the projections at load: int8 per channel or int4 in groups",
                              QUANTIZATIONS)
    device: str = param("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    seed: int = param(0, "engine seed (a request's seed overrides it)")
    cpu_threads: int | None = param(None, "torch intra-op threads on the CPU (default: torch's)")
    # ranks the model is split over (pagedserve/backend/worker/parallel.py)
    tensor_parallel_size: int = param(1, "split the model over N ranks (N - 1 worker processes; gloo on the CPU, "
                                         "NCCL on GPUs)")
    data_parallel_rank: int = param(0, "this engine's rank among data-parallel replicas (vLLM's): its metrics' engine "
                                       "label, its KV events' rank and port offset (serve --data-parallel-size sets it)")
    runner: str = param("auto", "what the engine serves: generate, pooling (embed / classify / score) or all (a "
                                "decoder generating and pooling); auto: pooling for an encoder, a classifier or a "
                                "sentence-transformers folder, else generate", RUNNERS)
    max_pooling_inputs: int = param(2048, "most inputs (texts, token lists, documents, pairs) one pooling request "
                                          "to the OpenAI shim may carry, as TEI's --max-client-batch-size; more are "
                                          "refused naming the input field")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a non-empty string", "model")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}", "dtype")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}", "quantization")
        device = self.device
        if not isinstance(device, str) or not (
            device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())
        ):
            raise ConfigError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}", "device"
            )
        _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1, 1024)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL_SIZE)
        _check_int("data_parallel_rank", self.data_parallel_rank, 0, 1023)
        _check_int("max_pooling_inputs", self.max_pooling_inputs, 1, 1 << 20)
        if self.runner not in RUNNERS:
            raise ConfigError(f"runner must be one of {RUNNERS}, got {self.runner!r}", "runner")


MAX_LORA_RANK = 512  # vLLM's largest choice


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving: `max_loras` adapters resident in the model's slots at once (the most one step
    mixes), ranks up to `max_lora_rank`, `max_cpu_loras` adapters kept in host memory (default: max_loras)."""

    enable_lora: bool = param(False, "serve LoRA adapters (ones listed at start and ones loaded at run time)")
    max_loras: int = param(1, "adapters resident for the batch at once")
    max_lora_rank: int = param(16, "the largest adapter rank served")
    max_cpu_loras: int | None = param(None, "adapters kept in CPU memory at once (default: max_loras)")

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ConfigError(f"enable_lora must be a bool, got {self.enable_lora!r}", "enable_lora")
        _check_int("max_loras", self.max_loras, 1, 256)
        _check_int("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check_int("max_cpu_loras", self.max_cpu_loras, 1)
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})", "max_cpu_loras")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: n-gram (prompt-lookup) drafts of `num_speculative_tokens`, matched on the
    last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min` (one given sets the other), or
    (method "draft_model") the greedy continuation of the draft model folder `model`, which shares the
    target's tokenizer; no drafts in a step while `disable_by_batch_size` or more requests run (None: always)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
                "speculative_config.method",
            )
        self._check_model()
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        if self.disable_by_batch_size is not None:
            _check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5  # vLLM's default when neither is given
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                _check_int(f"speculative_config.{name}", getattr(self, name), 1, 1024)
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})",
                "speculative_config.prompt_lookup_min",
            )

    def _check_model(self) -> None:
        """A draft model is a folder, given with method draft_model only."""
        if self.method != "draft_model":
            if self.model is not None:
                raise ConfigError(
                    f"speculative_config.model is for method 'draft_model', not {self.method!r}",
                    "speculative_config.model")
            return
        if not isinstance(self.model, str) or not Path(self.model).is_dir():
            raise ConfigError(
                f"speculative_config.model must be a model folder for method 'draft_model', got {self.model!r}",
                "speculative_config.model")

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig | None:
        """None (speculation off), a dict with vLLM's keys, or its JSON text (a Triton parameter, a CLI flag)."""
        if value is None or value == "" or value == {}:
            return None
        value = json_object(value, "speculative_config", ConfigError)
        keys = [item.name for item in fields(cls)]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise ConfigError(
                f"speculative_config has unknown keys {unknown}; allowed: {', '.join(keys)}",
                f"speculative_config.{unknown[0]}",
            )
        if "num_speculative_tokens" not in value:
            raise ConfigError(
                "speculative_config.num_speculative_tokens is required", "speculative_config.num_speculative_tokens")
        return cls(**value)
