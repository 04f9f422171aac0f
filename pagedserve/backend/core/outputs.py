"""What the engine hands back per step: RequestOutput with one CompletionOutput per returned sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.backend.core.errors import ErrorKind


@dataclass
class CompletionOutput:
    """One returned sequence: cumulative text and tokens, plus what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        """True once this sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one user request after a step; `finished` is True exactly once, on its last output.
    An `error` ends it: `error_kind` says which (INTERNAL for a failed step, TIMEOUT for its timeout)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None
    pooled: list[float] | None = None  # a pooling request's vector: embedding, class probabilities or score


@dataclass
class EngineStats:
    """Counters and gauges for metrics; totals count since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    mm_cache_queries: int = 0  # images looked up in the encoder cache (vLLM's vllm:mm_cache_queries)
    mm_cache_hits: int = 0  # of those, found there: not encoded again
    spec_decode_num_drafts: int = 0  # sequences' draft runs verified (vLLM's spec_decode_num_drafts)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # index: draft position
    # vLLM's vllm:lora_requests_info: the adapters of running and of waiting requests, and max_loras (0: off).
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
