"""What the llm model's threads need from their surroundings, as Protocols: the engine (LLMEngine), the logger
(pb_utils.Logger), the response objects (tensors.TritonResponses), the output encoder and the metrics. The
threads import no triton_python_backend_utils, so tests/triton drives them with fakes in plain pytest."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Protocol

from pagedserve.backend.core.outputs import EngineStats, RequestOutput
from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.core.sampling_params import SamplingParams

# TRITONSERVER_RESPONSE_COMPLETE_FINAL (tritonserver.h): the flag of a request's last response. llm_model
# checks that pb_utils agrees.
FINAL = 1


class GrammarCompiler(Protocol):
    """The engine's structured-output compiler, as the engine loop uses it."""

    def compile_async(self, spec: dict) -> Future: ...


class EngineClient(Protocol):
    """The engine as the engine loop drives it, all from its one thread."""

    structured: GrammarCompiler

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    add_special_tokens: bool = True, priority: int = 0, timeout: float | None = None,
                    images: Any = None) -> None: ...

    def add_pooling_request(self, request_id: str, prompt: str | None, params: PoolingParams | None = None,
                            prompt_token_ids: list[int] | None = None, text_pair: str | None = None,
                            arrival_time: float | None = None, priority: int = 0,
                            timeout: float | None = None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def failure(self) -> str | None: ...

    def get_stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...

    def add_lora(self, name: str, path: str) -> None: ...

    def remove_lora(self, name: str) -> None: ...

    def list_loras(self) -> dict[str, str]: ...


class Log(Protocol):
    """Where the threads log: pb_utils.Logger (tritonserver's log) in the model, Python logging elsewhere."""

    def log_info(self, message: str) -> None: ...

    def log_warn(self, message: str) -> None: ...

    def log_error(self, message: str) -> None: ...


class PythonLog:
    """A Log writing through Python's `logging` (the default outside a Triton stub)."""

    def __init__(self, name: str = "pagedserve.triton"):
        self._logger = logging.getLogger(name)

    def log_info(self, message: str) -> None:
        self._logger.info(message)

    def log_warn(self, message: str) -> None:
        self._logger.warning(message)

    def log_error(self, message: str) -> None:
        self._logger.error(message)


class ResponseFactory(Protocol):
    """Builds the response objects a request's sender sends."""

    def output(self, tensors: list) -> Any: ...

    def error(self, error: BaseException) -> Any: ...

    def cancelled(self) -> Any: ...

    def control(self, answer: dict) -> Any: ...


class Encoder(Protocol):
    """Turns one engine output into a request's response tensors (encoding.OutputEncoder)."""

    def tensors(self, request: Any, output: RequestOutput) -> list: ...


class Metrics(Protocol):
    """The metrics the response threads publish (metrics.EngineMetrics)."""

    def update(self, stats: EngineStats) -> None: ...

    def count_step_failure(self) -> None: ...

    def observe(self, histogram: str, seconds: float) -> None: ...
