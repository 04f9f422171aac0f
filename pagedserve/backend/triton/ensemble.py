"""The `ensemble` model with TensorRT-LLM's tensors, and the tokenizing (`preprocessing`) and detokenizing
(`postprocessing`) steps as models of their own.

`ensemble` is a decoupled Python model, not a Triton `platform: "ensemble"`: TensorRT-LLM's clients send a batch
dimension (`max_batch_size` 64, every input `[batch, ...]`), and a platform ensemble hands all the rows of a call
to the `llm` step as one request, which the vLLM-shaped `llm` (`max_batch_size` 0) reads as one prompt. Here each
row is tokenized, streamed through `llm` as its own BLS request on its own thread, and detokenized, every response
carrying its row's `batch_index`.

Loaded only inside Triton's Python backend stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.backend.core.errors import ErrorKind, InvalidRequestError, from_wire, to_wire
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.detokenizer import detokenize_incrementally
from pagedserve.backend.triton.ensemble_images import (
    IMAGE_BYTES,
    IMAGE_URL,
    RowImages,
    image_error_field,
    row_images,
)
from pagedserve.backend.triton.inputs import MAX_PROMPT_BYTES, input_tensors, request_parameters
from pagedserve.backend.triton.tensors import error_response, string_tensor

LLM_MODEL_NAME = "llm"
# What the llm model sends on the token-id path, all the ensemble needs to decode a response statelessly.
_LLM_OUTPUTS = ["output_ids", "prefix_ids", "read_offset", "finish_reason", "cumulative_logprob", "logprobs"]
# A row with images runs on the llm's text path (its processor expands the placeholders): text, not ids, back.
_LLM_TEXT_OUTPUTS = ["text_output", "finish_reason", "cumulative_logprob", "logprobs"]
# TensorRT-LLM ensemble inputs that map one to one onto a SamplingParams name.
_SAMPLING_INPUTS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "beam_width",
)
# SamplingParams name -> the names TensorRT-LLM releases gave that input (up to 0.17: random_seed, min_length).
_RENAMED_INPUTS = {"seed": ("seed", "random_seed"), "min_tokens": ("min_tokens", "min_length")}
# TensorRT-LLM outputs pagedserve does not produce: their request flags are accepted only when false.
_UNSUPPORTED_FLAGS = ("return_context_logits", "return_generation_logits", "return_perf_metrics")
GUIDE_TYPE = "guided_decoding_guide_type"
GUIDE = "guided_decoding_guide"
# TensorRT-LLM's guide types -> the llm's structured_outputs kind; its `json` is any JSON, with no schema.
_GUIDE_KINDS = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


class RowInputs:
    """One request's input tensors, read row by row: `[batch, ...]` tensors of a batching model, or, with
    `batched` false, each whole tensor as the single row."""

    def __init__(self, request: Any, batched: bool):
        self._tensors = {name: tensor.as_numpy() for name, tensor in input_tensors(request).items()}
        self._batched = batched
        first = next(iter(self._tensors.values()), None)
        self.num_rows = len(first) if batched and first is not None else 1

    def has(self, name: str) -> bool:
        """Whether the request carries the input `name`."""
        return name in self._tensors

    def values(self, name: str, row: int) -> np.ndarray | None:
        """The elements of input `name` in `row`, flat; None when the input is absent."""
        array = self.row_array(name, row)
        return None if array is None else array.reshape(-1)

    def row_array(self, name: str, row: int) -> np.ndarray | None:
        """Input `name` in `row` with its shape; None when the input is absent."""
        array = self._tensors.get(name)
        if array is None:
            return None
        return array[row] if self._batched else array

    def scalar(self, name: str, row: int) -> Any:
        """The single value of a `[1]` input as a Python number or bool, None when absent."""
        values = self.values(name, row)
        return values[0].item() if values is not None else None

    def strings(self, name: str, row: int) -> list[str]:
        """The non-empty UTF-8 strings of a STRING input (clients pad ragged rows with empty strings)."""
        values = self.values(name, row)
        if values is None:
            return []
        try:
            return [bytes(v).decode("utf-8") for v in values if len(v)]
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name} is not valid UTF-8", name) from None

    def text(self, name: str, row: int) -> str:
        """The required, non-empty prompt string of `row`, refused when over MAX_PROMPT_BYTES."""
        values = self.values(name, row)
        raw = bytes(values[0]) if values is not None and len(values) else b""
        if len(raw) > MAX_PROMPT_BYTES:
            raise InvalidRequestError(f"{name} must be at most {MAX_PROMPT_BYTES} bytes, got {len(raw)}", name)
        if not raw:
            raise InvalidRequestError(f"{name} must not be empty", name)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError(
                f"{name} is not valid UTF-8 ({error.reason} at byte {error.start})", name
            ) from None


def row_sampling_parameters(inputs: RowInputs, row: int) -> dict[str, Any]:
    """The llm's sampling_parameters JSON object from the TensorRT-LLM-named inputs of one row, validated."""
    settings = {}
    for name in _SAMPLING_INPUTS:
        value = inputs.scalar(name, row)
        if value is not None:
            # FP32 inputs arrive as e.g. 0.699999988: keep the value the client wrote.
            settings[name] = round(value, 6) if isinstance(value, float) else value
    for param, names in _RENAMED_INPUTS.items():
        given = [name for name in names if inputs.has(name)]
        if len(given) > 1:
            raise InvalidRequestError(f"give {names[0]} or {names[1]}, not both", names[1])
        if given:
            settings[param] = inputs.scalar(given[0], row)
    stop = inputs.strings("stop_words", row)
    if stop:
        settings["stop"] = stop
    bad_words = inputs.strings("bad_words", row)
    if bad_words:
        settings["bad_words"] = bad_words
    end_id = inputs.scalar("end_id", row)
    if end_id is not None:
        settings["stop_token_ids"] = [end_id]
    num_sequences = inputs.scalar("num_return_sequences", row)
    if num_sequences is not None and num_sequences != 1:
        raise InvalidRequestError(
            f"num_return_sequences must be 1 through the ensemble (use the llm model's n), got {num_sequences}",
            "num_return_sequences",
        )
    for flag in _UNSUPPORTED_FLAGS:
        if inputs.scalar(flag, row):
            raise InvalidRequestError(f"{flag} is not supported by pagedserve", flag)
    if inputs.scalar("return_log_probs", row):
        settings["logprobs"] = 0
    structured = row_structured_outputs(inputs, row)
    if structured is not None:
        settings["structured_outputs"] = structured
    lora_name = next(iter(inputs.strings("lora_name", row)), "")
    if lora_name:  # an empty one pads the rows of a batch that run on the base model
        settings["lora_name"] = lora_name
    SamplingParams.from_dict(settings)
    return settings


def row_structured_outputs(inputs: RowInputs, row: int) -> dict | None:
    """The llm's structured_outputs from TensorRT-LLM's guided decoding inputs of one row; None when the row
    has no guide type (an empty one pads the rows of a batch that go unguided)."""
    guide_type = next(iter(inputs.strings(GUIDE_TYPE, row)), "")
    guide = next(iter(inputs.strings(GUIDE, row)), "")
    if not guide_type:
        if guide:
            raise InvalidRequestError(f"{GUIDE_TYPE} must be given with {GUIDE}", GUIDE_TYPE)
        return None
    kind = _GUIDE_KINDS.get(guide_type)
    if kind is None:
        raise InvalidRequestError(f"{GUIDE_TYPE} must be one of {', '.join(_GUIDE_KINDS)}, got {guide_type!r}",
                                  GUIDE_TYPE)
    if kind == "json_object":
        return {kind: True}  # as TensorRT-LLM, which reads no guide for this type
    if not guide:
        raise InvalidRequestError(f"{GUIDE} must not be empty with {GUIDE_TYPE} {guide_type}", GUIDE)
    if kind != "json":
        return {kind: guide}
    try:
        schema = json.loads(guide)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(f"{GUIDE} is not valid JSON: {error}", GUIDE) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{GUIDE} must be a JSON Schema object, got {type(schema).__name__}", GUIDE)
    return {kind: schema}


def row_error_message(message: str, image_field: str | None = None) -> str:
    """An llm error of one row as the ensemble's client should read it: a refusal of the structured_outputs
    made from the guide names the guide input the client sent, one of the row's images its image input."""
    wire = from_wire(message)
    if wire is None or wire.kind is not ErrorKind.INVALID_ARGUMENT:
        return message
    field = GUIDE if wire.field == "structured_outputs" else image_error_field(wire.field, image_field)
    return message if field == wire.field else to_wire(InvalidRequestError(wire.message, field))


@dataclass
class EnsembleRow:
    """One validated, tokenized batch row: what its llm request carries."""

    prompt_token_ids: list[int] | None  # None with images: the llm tokenizes `prompt` with its processor
    sampling_parameters: dict[str, Any]
    stream: bool
    exclude_input_in_output: bool
    prompt: str = ""
    images: RowImages | None = None


def parse_ensemble_request(request: Any, tokenizer: Any) -> list[EnsembleRow]:
    """Validate and tokenize every row of an ensemble request; InvalidRequestError names the field (and, in a
    batch of several, the row's batch_index)."""
    unknown = sorted(request_parameters(request))
    if unknown:
        # The generate endpoint turns JSON fields that are not inputs into parameters.
        raise InvalidRequestError(f"{unknown[0]} is not an input of the ensemble model", unknown[0])
    inputs = RowInputs(request, batched=True)
    rows = []
    for row in range(inputs.num_rows):
        try:
            prompt = inputs.text("text_input", row)
            images = row_images(inputs.row_array(IMAGE_BYTES, row), inputs.strings(IMAGE_URL, row))
            rows.append(EnsembleRow(
                prompt_token_ids=None if images else tokenizer.encode(prompt),
                sampling_parameters=row_sampling_parameters(inputs, row),
                stream=bool(inputs.scalar("stream", row)),
                exclude_input_in_output=bool(inputs.scalar("exclude_input_in_output", row)),
                prompt=prompt,
                images=images,
            ))
        except InvalidRequestError as error:
            if inputs.num_rows == 1:
                raise
            raise InvalidRequestError(f"{error} (batch_index {row})", error.field) from None
    return rows


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


@dataclass
class DecodedResponse:
    """One llm response of the token-id path, decoded: its new text and log probabilities."""

    text: str
    cumulative_logprob: float
    token_logprobs: list[float]
    final: bool


def decode_llm_response(tokenizer: Any, outputs: dict[str, np.ndarray]) -> DecodedResponse:
    """Decode the `output_ids` of one llm response from its `prefix_ids` and `read_offset` (no state kept)."""
    token_ids = [int(t) for t in outputs["prefix_ids"].reshape(-1)] + [int(t) for t in outputs["output_ids"].reshape(-1)]
    final = bool(bytes(outputs["finish_reason"].reshape(-1)[0]))
    logprobs = json.loads(bytes(outputs["logprobs"].reshape(-1)[0]).decode("utf-8") or "[]")
    return DecodedResponse(
        text=decode_new_text(tokenizer, token_ids, int(outputs["read_offset"].reshape(-1)[0]), final),
        cumulative_logprob=float(outputs["cumulative_logprob"].reshape(-1)[0]),
        token_logprobs=[entry["logprob"] for entry in logprobs],
        final=final,
    )


def decode_text_response(outputs: dict[str, np.ndarray]) -> DecodedResponse:
    """One llm response of the text path (a row with images): its text as the llm detokenized it."""
    logprobs = json.loads(bytes(outputs["logprobs"].reshape(-1)[0]).decode("utf-8") or "[]")
    return DecodedResponse(
        text=bytes(outputs["text_output"].reshape(-1)[0]).decode("utf-8"),
        cumulative_logprob=float(outputs["cumulative_logprob"].reshape(-1)[0]),
        token_logprobs=[entry["logprob"] for entry in logprobs],
        final=bool(bytes(outputs["finish_reason"].reshape(-1)[0])),
    )


def load_tokenizer(args: dict) -> Any:
    """The tokenizer named by the model's `tokenizer` parameter (the default model when empty)."""
    from transformers import AutoTokenizer

    config = json.loads(args["model_config"])
    path = config.get("parameters", {}).get("tokenizer", {}).get("string_value", "")
    if not path:
        from pagedserve.backend.model.default_model import ensure_default_model

        path = str(ensure_default_model())
    return AutoTokenizer.from_pretrained(path)


def ensemble_output_tensors(decoded: DecodedResponse, row: int) -> list:
    """One row's response in the shapes TensorRT-LLM's ensemble sends: `text_output` [1] (as its postprocessing
    step flattens it), the others [1, beams] with one beam: `cum_log_probs` [1, 1], `output_log_probs` [1, 1, T],
    `batch_index` and `sequence_index` [1, 1]."""
    return [
        string_tensor("text_output", [decoded.text]),
        pb_utils.Tensor("cum_log_probs", np.full((1, 1), decoded.cumulative_logprob, dtype=np.float32)),
        pb_utils.Tensor("output_log_probs", np.asarray(decoded.token_logprobs, dtype=np.float32).reshape(1, 1, -1)),
        pb_utils.Tensor("batch_index", np.full((1, 1), row, dtype=np.int32)),
        pb_utils.Tensor("sequence_index", np.zeros((1, 1), dtype=np.int32)),
    ]


def _llm_request(row: EnsembleRow) -> Any:
    """The BLS request that runs one row on the llm model: token ids, or the prompt text with the images."""
    inputs = [
        string_tensor("sampling_parameters", [json.dumps(row.sampling_parameters)]),
        pb_utils.Tensor("stream", np.asarray([row.stream])),
        pb_utils.Tensor("exclude_input_in_output", np.asarray([row.exclude_input_in_output])),
    ]
    if row.images is None:
        inputs.append(pb_utils.Tensor("input_ids", np.asarray(row.prompt_token_ids, dtype=np.int32)))
        return pb_utils.InferenceRequest(model_name=LLM_MODEL_NAME, inputs=inputs, requested_output_names=_LLM_OUTPUTS)
    inputs += [string_tensor("text_input", [row.prompt]), string_tensor("image", row.images.files)]
    inputs += [pb_utils.Tensor(flag, np.asarray([True])) for flag in
               ("return_finish_reason", "return_cumulative_logprob", "return_logprobs")]
    return pb_utils.InferenceRequest(model_name=LLM_MODEL_NAME, inputs=inputs,
                                     requested_output_names=_LLM_TEXT_OUTPUTS)


class BatchResponder:
    """The response sender of one ensemble request, shared by its rows' threads: sends are serialized and
    the response that ends the last open row carries the final flag."""

    def __init__(self, sender: Any, num_rows: int):
        self._sender = sender
        self._open_rows = set(range(num_rows))
        self._lock = threading.Lock()
        self._num_rows = num_rows

    def send(self, row: int, tensors: list, last: bool) -> None:
        """A data response of `row`; `last` ends the row."""
        self._send(row, pb_utils.InferenceResponse(output_tensors=tensors), last)

    def fail(self, row: int, message: str, code: Any) -> None:
        """End `row` with an error response (its batch_index named when the batch has several rows)."""
        if self._num_rows > 1:
            # Before the wire tag an llm error ends with, which must stay last.
            wire = from_wire(message)
            head = wire.message if wire else message
            message = f"{head} (batch_index {row}){message[len(head):]}"
        self._send(row, pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code)),
                   last=True)

    def close(self, row: int) -> None:
        """End `row` if its responses did not; the final flag goes out alone if it was the last open row."""
        with self._lock:
            if row in self._open_rows:
                self._open_rows.discard(row)
                if not self._open_rows:
                    self._sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send(self, row: int, response: Any, last: bool) -> None:
        with self._lock:
            if row not in self._open_rows:
                return
            if last:
                self._open_rows.discard(row)
            final = not self._open_rows
            self._sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)


class EnsembleModel:
    """`ensemble`: TensorRT-LLM's tensors in, each batch row streamed through the llm model and detokenized."""

    def initialize(self, args: dict) -> None:
        """Load the tokenizer."""
        self.tokenizer = load_tokenizer(args)

    def execute(self, requests: list) -> None:
        """Validate and tokenize each request, then stream its rows on threads; bad input is refused whole."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                rows = parse_ensemble_request(request, self.tokenizer)
            except Exception as error:  # noqa: BLE001 - every failure is answered, with the final flag
                sender.send(error_response(error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            responder = BatchResponder(sender, len(rows))
            for index, row in enumerate(rows):
                threading.Thread(target=self._stream_row, args=(responder, index, row),
                                 name=f"pagedserve-ensemble-row-{index}", daemon=True).start()
        return None

    def _stream_row(self, responder: BatchResponder, index: int, row: EnsembleRow) -> None:
        """Forward one row's llm responses, decoded, until its llm request ends."""
        try:
            for response in _llm_request(row).exec(decoupled=True):
                if response.has_error():
                    message = row_error_message(response.error().message(), row.images and row.images.field)
                    responder.fail(index, message, response.error().code())
                    continue
                outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
                if not outputs:
                    continue  # the llm's flags-only final response
                decoded = (decode_text_response(outputs) if row.images else
                           decode_llm_response(self.tokenizer, outputs))
                responder.send(index, ensemble_output_tensors(decoded, index), last=decoded.final)
        except Exception as error:  # noqa: BLE001 - the row still ends, with the reason
            responder.fail(index, to_wire(error), pb_utils.TritonError.INTERNAL)
        finally:
            responder.close(index)

    def finalize(self) -> None:
        """Nothing to release: rows still streaming end with their llm requests."""


class _TokenizerStep:
    """A non-decoupled model that answers each request alone with the model's tokenizer."""

    def initialize(self, args: dict) -> None:
        """Load the tokenizer."""
        self.tokenizer = load_tokenizer(args)

    def execute(self, requests: list) -> list:
        """One response per request."""
        return [self._one(request) for request in requests]

    def _one(self, request: Any) -> Any:
        raise NotImplementedError

    def finalize(self) -> None:
        """Nothing to release."""


class PreprocessingModel(_TokenizerStep):
    """The tokenizing step alone: `text_input` -> `input_ids`, TensorRT-LLM sampling inputs -> sampling JSON;
    bad input gets an INVALID_ARG error response."""

    def _one(self, request: Any) -> Any:
        try:
            inputs = RowInputs(request, batched=False)
            for name in (IMAGE_BYTES, IMAGE_URL):
                if inputs.has(name):  # the llm takes images only beside a text prompt, which it tokenizes
                    raise InvalidRequestError(f"{name}: input_ids carry no image; send images through the ensemble "
                                              "or the llm model's image input", name)
            text = inputs.text("text_input", 0)
            settings = row_sampling_parameters(inputs, 0)
            ids = self.tokenizer.encode(text)
        except InvalidRequestError as error:
            return error_response(error)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32)),
            string_tensor("sampling_parameters", [json.dumps(settings)]),
        ])


class PostprocessingModel(_TokenizerStep):
    """The detokenizing step alone: the new ids of one llm response -> their exact text, with no state kept."""

    def _one(self, request: Any) -> Any:
        outputs = {name: tensor.as_numpy() for name, tensor in input_tensors(request).items()}
        decoded = decode_llm_response(self.tokenizer, outputs)
        return pb_utils.InferenceResponse(output_tensors=[
            string_tensor("text_output", [decoded.text]),
            pb_utils.Tensor("cum_log_probs", np.asarray([decoded.cumulative_logprob], dtype=np.float32)),
            pb_utils.Tensor("output_log_probs", np.asarray(decoded.token_logprobs, dtype=np.float32)),
            pb_utils.Tensor("sequence_index", np.zeros(1, dtype=np.int32)),
        ])
