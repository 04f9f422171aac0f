"""Reading one `llm` request: its input tensors and KServe parameters, validated into LLMRequestInputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams

# KServe request parameters that Triton or its clients set for themselves, not sampling settings.
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


def request_parameters(request: Any) -> dict[str, Any]:
    """KServe request `parameters` (the generate endpoint's extra JSON fields) meant for sampling."""
    raw = request.parameters()
    params = json.loads(raw) if isinstance(raw, str) and raw else dict(raw or {})
    return {k: v for k, v in params.items() if k not in _RESERVED_PARAMETERS and not k.startswith("triton_")}


def parse_llm_request(request: Any) -> LLMRequestInputs:
    """Read and validate one `llm` request; InvalidRequestError names the offending field."""
    inputs = input_tensors(request)
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
    settings = request_parameters(request)
    raw_json = string_input(inputs, "sampling_parameters", MAX_SAMPLING_PARAMETERS_BYTES)
    if raw_json:
        try:
            from_json = json.loads(raw_json)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {error}", "sampling_parameters") from None
        if not isinstance(from_json, dict):
            raise InvalidRequestError(
                f"sampling_parameters must be a JSON object, got {type(from_json).__name__}", "sampling_parameters"
            )
        settings.update(from_json)
    params = SamplingParams.from_dict(settings)
    flags = {name: _bool_input(inputs, name) for name in _RETURN_FLAGS}
    return LLMRequestInputs(
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        params=params,
        stream=_bool_input(inputs, "stream"),
        exclude_input_in_output=_bool_input(inputs, "exclude_input_in_output"),
        add_special_tokens=_bool_input(inputs, "add_special_tokens", default=True),
        **flags,
    )
