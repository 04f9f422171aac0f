"""Triton glue shared by the models: parsing `llm` requests, error responses, and the ensemble's
tokenizing (preprocessing) and detokenizing (postprocessing) steps.

Loaded only inside Triton's Python backend stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from pagedserve.backend.core.errors import (
    INTERNAL_ERROR_PREFIX,
    InvalidRequestError,
    ServerBusyError,
    ShuttingDownError,
)
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.detokenizer import detokenize_incrementally

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


def _string_input(inputs: dict[str, Any], name: str, max_bytes: int | None = None) -> str | None:
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


def _request_parameters(request: Any) -> dict[str, Any]:
    """KServe request `parameters` (the generate endpoint's extra JSON fields) meant for sampling."""
    raw = request.parameters()
    params = json.loads(raw) if isinstance(raw, str) and raw else dict(raw or {})
    return {k: v for k, v in params.items() if k not in _RESERVED_PARAMETERS and not k.startswith("triton_")}


def parse_llm_request(request: Any) -> LLMRequestInputs:
    """Read and validate one `llm` request; InvalidRequestError names the offending field."""
    inputs = input_tensors(request)
    prompt = _string_input(inputs, "text_input", MAX_PROMPT_BYTES)
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
    settings = _request_parameters(request)
    raw_json = _string_input(inputs, "sampling_parameters", MAX_SAMPLING_PARAMETERS_BYTES)
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


def error_response(error: BaseException) -> Any:
    """An InferenceResponse carrying `error` with the status a client should see."""
    message = str(error)
    if isinstance(error, InvalidRequestError):
        code = pb_utils.TritonError.INVALID_ARG
        if error.field and not message.startswith(error.field):
            # The field leads every refusal, so clients (the OpenAI shim's `param`) can read it off.
            message = f"{error.field}: {message}"
    elif isinstance(error, (ServerBusyError, ShuttingDownError)):
        code = pb_utils.TritonError.UNAVAILABLE
    else:
        code = pb_utils.TritonError.INTERNAL
        if not message.startswith(INTERNAL_ERROR_PREFIX):
            message = INTERNAL_ERROR_PREFIX + message
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def string_tensor(name: str, values: Sequence[str]) -> Any:
    """A STRING tensor of UTF-8 encoded values."""
    return pb_utils.Tensor(name, np.array([v.encode("utf-8") for v in values], dtype=np.object_))


def decode_new_text(tokenizer: Any, token_ids: Sequence[int], read_offset: int, final: bool,
                    skip_special_tokens: bool = True) -> str:
    """Text of the ids after `read_offset`, decoding from the start of `token_ids` for context.

    Not final: a trailing incomplete character is held back (the llm resends it next time).
    Final: everything is released, incomplete characters included.
    """
    if not final:
        return detokenize_incrementally(tokenizer, token_ids, 0, read_offset, skip_special_tokens)[0]
    head = tokenizer.decode(token_ids[:read_offset], skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)[len(head):]


def _load_tokenizer(args: dict) -> Any:
    """The tokenizer named by the model's `tokenizer` parameter (the default model when empty)."""
    from transformers import AutoTokenizer

    config = json.loads(args["model_config"])
    path = config.get("parameters", {}).get("tokenizer", {}).get("string_value", "")
    if not path:
        from pagedserve.backend.worker.default_model import ensure_default_model

        path = str(ensure_default_model())
    return AutoTokenizer.from_pretrained(path)


def _scalar(inputs: dict[str, Any], name: str) -> Any:
    """The single value of an optional scalar input as a Python number/bool, None when absent."""
    tensor = inputs.get(name)
    return tensor.as_numpy().reshape(-1)[0].item() if tensor is not None else None


def _strings(inputs: dict[str, Any], name: str) -> list[str]:
    tensor = inputs.get(name)
    if tensor is None:
        return []
    try:
        return [bytes(v).decode("utf-8") for v in tensor.as_numpy().reshape(-1) if len(v)]
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{name} is not valid UTF-8", name) from None


# TensorRT-LLM ensemble input -> SamplingParams name, for the inputs that map one to one.
_ENSEMBLE_SAMPLING_INPUTS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "beam_width": "beam_width",
    "min_tokens": "min_tokens",
}


def ensemble_sampling_parameters(inputs: dict[str, Any]) -> dict[str, Any]:
    """The llm's sampling_parameters JSON object from the TensorRT-LLM-named ensemble inputs (input_tensors)."""
    settings = {}
    for input_name, param in _ENSEMBLE_SAMPLING_INPUTS.items():
        value = _scalar(inputs, input_name)
        if value is not None:
            settings[param] = round(value, 6) if isinstance(value, float) else value
    stop = _strings(inputs, "stop_words")
    if stop:
        settings["stop"] = stop
    if _strings(inputs, "bad_words"):
        raise InvalidRequestError("bad_words is not supported by pagedserve", "bad_words")
    end_id = _scalar(inputs, "end_id")
    if end_id is not None:
        settings["stop_token_ids"] = [end_id]
    num_sequences = _scalar(inputs, "num_return_sequences")
    if num_sequences is not None and num_sequences != 1:
        raise InvalidRequestError(
            f"num_return_sequences must be 1 through the ensemble (use the llm model's n), got {num_sequences}",
            "num_return_sequences",
        )
    if _scalar(inputs, "return_log_probs"):
        settings["logprobs"] = 0
    SamplingParams.from_dict(settings)
    return settings


class PreprocessingModel:
    """Ensemble step 1: `text_input` -> `input_ids`, TensorRT-LLM sampling inputs -> sampling JSON."""

    def initialize(self, args: dict) -> None:
        """Load the tokenizer."""
        self.tokenizer = _load_tokenizer(args)

    def execute(self, requests: list) -> list:
        """One response per request; bad input gets an INVALID_ARG error response."""
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        try:
            inputs = input_tensors(request)
            text = _string_input(inputs, "text_input", MAX_PROMPT_BYTES)
            if not text:
                raise InvalidRequestError("text_input must not be empty", "text_input")
            settings = ensemble_sampling_parameters(inputs)
            ids = self.tokenizer.encode(text)
        except InvalidRequestError as error:
            return error_response(error)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32)),
            string_tensor("sampling_parameters", [json.dumps(settings)]),
        ])

    def finalize(self) -> None:
        """Nothing to release."""


class PostprocessingModel:
    """Ensemble step 3: the new ids of one llm response -> their exact text, with no state kept."""

    def initialize(self, args: dict) -> None:
        """Load the tokenizer."""
        self.tokenizer = _load_tokenizer(args)

    def execute(self, requests: list) -> list:
        """One response per llm response."""
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        inputs = input_tensors(request)

        def array(name: str) -> np.ndarray:
            return inputs[name].as_numpy().reshape(-1)

        token_ids = [int(t) for t in array("prefix_ids")] + [int(t) for t in array("output_ids")]
        final = bool(bytes(array("finish_reason")[0]))
        text = decode_new_text(self.tokenizer, token_ids, int(array("read_offset")[0]), final)
        logprobs = json.loads(bytes(array("logprobs")[0]).decode("utf-8") or "[]")
        return pb_utils.InferenceResponse(output_tensors=[
            string_tensor("text_output", [text]),
            pb_utils.Tensor("cum_log_probs", array("cumulative_logprob")[:1].astype(np.float32)),
            pb_utils.Tensor("output_log_probs", np.asarray([e["logprob"] for e in logprobs], dtype=np.float32)),
            pb_utils.Tensor("sequence_index", np.zeros(1, dtype=np.int32)),
        ])

    def finalize(self) -> None:
        """Nothing to release."""
