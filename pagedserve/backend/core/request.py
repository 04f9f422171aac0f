"""One sequence's state as the scheduler sees it: tokens, progress, status."""

from __future__ import annotations

import enum
import time

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.multimodal import ImageInput
from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every finished state sorts after PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for every terminal state."""
        return status > RequestStatus.PREEMPTED


# Bounds of a request's priority: any int64, as a Triton or vLLM client may send one.
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence: prompt plus generated tokens, and how many of them have KV in the cache.

    n>1 and beam search are several Requests sharing a `group_id`; the scheduler forks them.
    `max_tokens` is resolved against `max_model_len` by the scheduler when params leave it None.
    `priority` orders it under the "priority" scheduling policy: lower first, 0 by default (vLLM's).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "output_token_ids",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "status",
        "arrival_time",
        "priority",
        "max_tokens",
        "cache_salt",
        "block_hashes",
        "num_cached_tokens",
        "group_id",
        "spec_token_ids",
        "mm_inputs",
        "pooling_params",
        "whole_prompt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        group_id: str | None = None,
        priority: int = 0,
        mm_inputs: tuple[ImageInput, ...] = (),
        pooling_params: PoolingParams | None = None,
        whole_prompt: bool = False,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        _check_prompt(prompt_token_ids)
        check_priority(priority)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.max_tokens: int | None = self.sampling_params.max_tokens
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1
        self.group_id = group_id
        # Draft tokens proposed for the next step (speculative decoding); the scheduler takes them.
        self.spec_token_ids: list[int] = []
        # The prompt's images in position order (core/multimodal.py); () for a text-only prompt.
        self.mm_inputs = mm_inputs
        # A pooling request is prefill only (no token to sample: max_tokens 0); `whole_prompt`: its prompt runs in
        # one step, never chunked (an encoder's bidirectional attention, a pooling over every prompt token).
        self.pooling_params = pooling_params
        self.whole_prompt = whole_prompt
        if pooling_params is not None:
            self.max_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """The most recent token (the next forward's input once the prompt is computed)."""
        return self.all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason ("stop", "length", "abort", "error"), None while unfinished."""
        return FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one generated token, keeping `all_token_ids` in step."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_priority(priority: object) -> None:
    """Raise InvalidRequestError unless `priority` is an int64 (bool is not an int)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", "priority")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequestError(f"priority must be in [-2**63, 2**63 - 1], got {priority}", "priority")


def _check_prompt(prompt_token_ids: object) -> None:
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise InvalidRequestError(
            "prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids"
        )
    for tok in prompt_token_ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise InvalidRequestError(
                f"prompt_token_ids entries must be integers >= 0, got {tok!r}", "prompt_token_ids"
            )
