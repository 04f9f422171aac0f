"""Reading one `llm` request: its input tensors and KServe parameters, validated into LLMRequestInputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError, json_object
from pagedserve.backend.core.request import check_priority
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.triton.image_inputs import image_input
from pagedserve.backend.triton.pooling_inputs import EMBEDDING_REQUEST, PoolingInputs, parse_embedding_request

# KServe request parameters that Triton or its clients set for themselves, not sampling settings (the llm
# model reads `priority` and `timeout` on their own).
_RESERVED_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers"}
# Longest text_input / sampling_parameters accepted, in UTF-8 bytes: refused before tokenizing, so a huge
# body costs no tokenizer time (the token limit, max_model_len, is the engine's check).
MAX_PROMPT_BYTES = 1 << 20
MAX_SAMPLING_PARAMETERS_BYTES = 64 * 1024
_RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


@dataclass
class LLMRequestInputs:
    """One validated `llm` request: the prompt (text or ids), its sampling params and output options."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    add_special_tokens: bool = True
    priority: int = 0  # the scheduling priority (lower first), 0 by default
    timeout: float | None = None  # seconds from arrival until the request ends with a timeout error
    images: Any = None  # the `image` input's files (image_inputs.py); the engine loop's processing future after
    pooling: PoolingInputs | None = None  # an embedding_request: pooled, not generated

    @property
    def from_ensemble(self) -> bool:
        """Token ids in: the ensemble path, whose responses carry ids for the postprocessing step."""
        return self.prompt_token_ids is not None


def input_tensors(request: Any) -> dict[str, Any]:
    """A request's input tensors by name. One `inputs()` call: pb_utils.get_input_tensor_by_name makes one per
    lookup (a list of tensor objects built each time), and an llm request looks up a dozen names."""
    return {tensor.name(): tensor for tensor in request.inputs()}


def string_input(inputs: dict[str, Any], name: str, max_bytes: int | None = None) -> str | None:
    """The single UTF-8 string of an optional STRING[1] input, refused when over `max_bytes`."""
    tensor = inputs.get(name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if max_bytes is not None and len(raw) > max_bytes:
        raise InvalidRequestError(f"{name} must be at most {max_bytes} bytes, got {len(raw)}", name)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"{name} is not valid UTF-8 ({error.reason} at byte {error.start})", name) from None


def _bool_input(inputs: dict[str, Any], name: str, default: bool = False) -> bool:
    """An optional BOOL[1] input, `default` when absent."""
    tensor = inputs.get(name)
    return bool(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else default


def _kserve_parameters(request: Any) -> dict[str, Any]:
    raw = request.parameters()
    return json.loads(raw) if isinstance(raw, str) and raw else dict(raw or {})


def _sampling_settings(kserve: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kserve.items() if k not in _RESERVED_PARAMETERS and not k.startswith("triton_")}


def request_parameters(request: Any) -> dict[str, Any]:
    """KServe request `parameters` (the generate endpoint's extra JSON fields) meant for sampling."""
    return _sampling_settings(_kserve_parameters(request))


def _int_setting(name: str, value: Any) -> int:
    """An integer request field, or its decimal text (as sampling parameters are converted)."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)


def _priority(kserve: dict[str, Any], settings: dict[str, Any]) -> int:
    """The `priority` of sampling_parameters (vLLM's field), else of the KServe parameters (the generate
    endpoint's `priority` field; Triton's 0 means the default level, which is 0 here too)."""
    value = settings.pop("priority", kserve.get("priority", 0))
    priority = _int_setting("priority", value)
    check_priority(priority)
    return priority


def _timeout_seconds(request: Any, kserve: dict[str, Any]) -> float | None:
    """The request's timeout: the KServe `timeout` parameter in microseconds (the generate endpoint's
    field), else Triton's request timeout (gRPC clients' `timeout=`); 0 or none is no timeout."""
    if "timeout" in kserve:
        micros = _int_setting("timeout", kserve["timeout"])
        if not 0 <= micros < 2**63:
            raise InvalidRequestError(f"timeout must be microseconds in [0, 2**63), got {micros}", "timeout")
    else:
        micros = request.timeout()
    return micros / 1e6 if micros else None


def parse_llm_request(request: Any, tensors: dict[str, Any] | None = None) -> LLMRequestInputs:
    """Read and validate one `llm` request (its input_tensors when already read); InvalidRequestError names the
    offending field."""
    inputs = input_tensors(request) if tensors is None else tensors
    embedding = string_input(inputs, EMBEDDING_REQUEST, MAX_PROMPT_BYTES)
    if embedding is not None:
        prompt, ids, pooling = parse_embedding_request(embedding)
        return LLMRequestInputs(prompt, ids, SamplingParams(), return_num_input_tokens=True, pooling=pooling,
                                timeout=_timeout_seconds(request, _kserve_parameters(request)))
    prompt = string_input(inputs, "text_input", MAX_PROMPT_BYTES)
    ids_tensor = inputs.get("input_ids")
    prompt_token_ids = [int(t) for t in ids_tensor.as_numpy().reshape(-1)] if ids_tensor is not None else None
    if prompt is None and prompt_token_ids is None:
        raise InvalidRequestError("text_input is required (a UTF-8 prompt string)", "text_input")
    if prompt is not None and prompt_token_ids is not None:
        raise InvalidRequestError("give either text_input or input_ids, not both", "input_ids")
    if prompt is not None and not prompt:
        raise InvalidRequestError("text_input must not be empty", "text_input")
    if prompt_token_ids is not None and not prompt_token_ids:
        raise InvalidRequestError("input_ids must hold at least one token id", "input_ids")
    kserve = _kserve_parameters(request)
    settings = _sampling_settings(kserve)
    raw_json = string_input(inputs, "sampling_parameters", MAX_SAMPLING_PARAMETERS_BYTES)
    if raw_json:
        settings.update(json_object(raw_json, "sampling_parameters"))
    priority = _priority(kserve, settings)
    params = SamplingParams.from_dict(settings)
    flags = {name: _bool_input(inputs, name) for name in _RETURN_FLAGS}
    return LLMRequestInputs(
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        params=params,
        stream=_bool_input(inputs, "stream"),
        exclude_input_in_output=_bool_input(inputs, "exclude_input_in_output"),
        add_special_tokens=_bool_input(inputs, "add_special_tokens", default=True),
        priority=priority,
        timeout=_timeout_seconds(request, kserve),
        images=image_input(inputs),
        **flags,
    )
