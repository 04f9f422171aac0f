"""The llm model's own settings (config.pbtxt `parameters` beside the engine's) and the timing constants of
its threads. The measurements behind each default are in docs/benchmarks.md ("Serving through Triton")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.parameters import EngineParameter, triton_parameters

# Cancellation is polled at most once per step (an aborted request can only leave between steps), and never
# more than CANCEL_POLLS_PER_SECOND round trips a second: each is_cancelled() costs both processes CPU.
CANCEL_POLL_SECONDS = 0.05
CANCEL_POLLS_PER_SECOND = 500.0
# A long step (a CPU prefill) does not slow polling further: the same polls notice an unload.
CANCEL_POLL_MAX_STEP_SECONDS = 1.0
READY_POLL_SECONDS = 0.5  # how often the cancel watcher asks whether the model is still ready
STATS_INTERVAL_SECONDS = 0.1
# Bounds how long the response and cancel threads wait for the GIL after each round trip to the server
# while the engine thread's Python runs (CPython's default is 5 ms). Set for the whole stub process.
GIL_SWITCH_INTERVAL_SECONDS = 5e-4
SHUTDOWN_TIMEOUT_SECONDS = 30.0  # finalize() waits this long for each thread
FENCE_TIMEOUT_SECONDS = 5.0  # a response thread stuck in a send must not stop the others for good
# After a step that made first tokens, the engine waits (at most this) until they are sent: each send takes
# GIL hand-overs that the next step's Python would delay by up to the switch interval.
FIRST_TOKEN_WAIT_SECONDS = 0.02
FIRST_TOKEN_WAIT_STEP_FRACTION = 0.05

# Defaults of the llm model's own config.pbtxt parameters.
# Triton waits for in-flight requests only up to its exit timeout; a decoupled request still streaming then
# meets a server that exits under it. Keep this below the exit timeout.
SHUTDOWN_GRACE_SECONDS = 5.0
# Off: it lowers closed-loop TTFT but puts new prefills among running decodes (ITL p99 up).
ADMISSION_WINDOW_MS = 0.0
ADMISSION_WINDOW_STEP_FRACTION = 0.1
# One thread: more overlap their sends' round trips but did not shorten the TTFT the path adds on 2 cores.
RESPONSE_THREADS = 1

# Set by the launcher: tritonserver's HTTP readiness URL, which the cancel watcher asks before
# pb_utils.is_model_ready (Triton 2.51's answer "server not ready" to that call can crash the stub).
HEALTH_URL_ENV = "PAGEDSERVE_TRITON_READY_URL"

LORA_RUNTIME_UPDATES_PARAMETER = "enable_lora_runtime_updates"


def _bool_value(raw: str) -> bool:
    """A config.pbtxt boolean ("true"/"false"/"1"/"0", any case); ValueError otherwise."""
    if raw.lower() not in ("true", "false", "1", "0"):
        raise ValueError(raw)
    return raw.lower() in ("true", "1")


def _engine_value(parameter: EngineParameter, raw: str) -> Any:
    """One engine parameter's value from its config.pbtxt string (JSON stays text the engine checks); ValueError
    when it does not parse."""
    if parameter.type is int:
        return int(raw)
    if parameter.type is float:
        return float(raw)
    if parameter.type is bool:
        return _bool_value(raw)
    if parameter.choices is not None and raw not in parameter.choices:
        raise ValueError(raw)
    return raw


def engine_arguments(parameters: dict[str, dict]) -> tuple[str, dict[str, Any]]:
    """(model path, LLMEngine.from_pretrained kwargs) from config.pbtxt `parameters`, for the engine parameters
    core/parameters.py lists; "" keeps a default. A value that does not parse is a ConfigError naming it."""
    values = {key: entry.get("string_value", "").strip() for key, entry in parameters.items()}
    kwargs: dict[str, Any] = {}
    for parameter in triton_parameters():
        key = parameter.name
        raw = values.get(key, "")
        if not raw:
            continue
        try:
            kwargs[key] = _engine_value(parameter, raw)
        except ValueError:
            allowed = f" (one of {', '.join(parameter.choices)})" if parameter.choices else ""
            raise ConfigError(f"config.pbtxt parameter {key} has a bad value {raw!r}{allowed}", key) from None
    return values.get("model", ""), kwargs


def model_number_parameter(parameters: dict[str, dict], key: str, default: float) -> float:
    """A number parameter of the llm model itself (not the engine's): finite and >= 0, `default` when empty."""
    raw = parameters.get(key, {}).get("string_value", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"config.pbtxt parameter {key} must be a number >= 0, got {raw!r}")
    return value


def model_bool_parameter(parameters: dict[str, dict], key: str) -> bool:
    """A boolean parameter of the llm model itself, false when empty."""
    raw = parameters.get(key, {}).get("string_value", "").strip()
    try:
        return bool(raw) and _bool_value(raw)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {key} must be true or false, got {raw!r}") from None


@dataclass(frozen=True)
class ModelSettings:
    """The llm model's own parameters, read once at initialize()."""

    shutdown_grace: float = SHUTDOWN_GRACE_SECONDS
    admission_window: float = ADMISSION_WINDOW_MS / 1e3  # seconds
    admission_fraction: float = ADMISSION_WINDOW_STEP_FRACTION
    response_threads: int = RESPONSE_THREADS
    # Load and unload LoRA adapters on a `lora_control` request (pagedserve/backend/triton/lora.py); listing is always on.
    lora_runtime_updates: bool = False

    @classmethod
    def from_parameters(cls, parameters: dict[str, dict]) -> ModelSettings:
        threads = model_number_parameter(parameters, "response_threads", RESPONSE_THREADS)
        if threads < 1 or threads != int(threads):
            raise ValueError(f"config.pbtxt parameter response_threads must be a whole number >= 1, got {threads:g}")
        return cls(
            shutdown_grace=model_number_parameter(parameters, "shutdown_grace_seconds", SHUTDOWN_GRACE_SECONDS),
            admission_window=model_number_parameter(parameters, "admission_window_ms", ADMISSION_WINDOW_MS) / 1e3,
            admission_fraction=model_number_parameter(parameters, "admission_window_step_fraction",
                                                      ADMISSION_WINDOW_STEP_FRACTION),
            response_threads=int(threads),
            lora_runtime_updates=model_bool_parameter(parameters, LORA_RUNTIME_UPDATES_PARAMETER),
        )
