"""The ensemble's tokenizing (preprocessing) and detokenizing (postprocessing) steps."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.detokenizer import detokenize_incrementally
from pagedserve.backend.triton.inputs import MAX_PROMPT_BYTES, input_tensors, string_input
from pagedserve.backend.triton.tensors import error_response, string_tensor


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
            text = string_input(inputs, "text_input", MAX_PROMPT_BYTES)
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
