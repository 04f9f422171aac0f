"""A small async client for the decoupled `llm` model over Triton's gRPC streaming API.

The OpenAI shim, the `generate`/`chat` commands and `pagedserve bench` all talk to `llm` through it.
Closing a `generate()` iterator early cancels the gRPC stream, which cancels the request on the server
(the model sees `response_sender.is_cancelled()` and frees the request's KV blocks). A stream whose request
has ended is never cancelled, but read to its end (see STREAM_END_TIMEOUT_SECONDS).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

LLM_MODEL = "llm"
# Once a request's last response has come, the server ends its stream at once; the client waits for that end
# (at most this long) instead of cancelling the stream. tritonserver 2.51's gRPC front end, told of a
# cancellation between writing a request's last response and closing its stream, cancels the finished request
# again, waits for an answer that never comes and so keeps the request, and with it the llm model: the next
# stop then runs out the exit timeout ("Exit timeout expired").
STREAM_END_TIMEOUT_SECONDS = 5.0


class TritonUnavailableError(ConnectionError):
    """tritonserver could not be reached (or the gRPC stream broke)."""


class TritonRequestError(RuntimeError):
    """The server ended a request with an error response; `message` is the server's text."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class LLMResponse:
    """One response of the `llm` model, one list element per returned sequence (index i = completion i).

    Streaming: `text` holds the new text of this step; otherwise the whole generated text.
    """

    text: list[str]
    finish_reason: list[str | None]
    num_input_tokens: int | None = None
    num_output_tokens: list[int] | None = None
    logprobs: list[list[dict]] | None = None
    cumulative_logprob: list[float] | None = None
    output_ids: list[int] | None = None
    # With `prompt_logprobs` in the sampling parameters, on the request's first response: one entry per
    # prompt token in the `logprobs` entries' shape (the first token's `logprob` and `top_logprobs` are None).
    prompt_logprobs: list[dict] | None = None

    @property
    def finished(self) -> bool:
        """True once every sequence has a finish reason."""
        return bool(self.finish_reason) and all(r is not None for r in self.finish_reason)


def build_inputs(
    prompt: str | None,
    input_ids: list[int] | None,
    sampling_parameters: dict,
    stream: bool,
    return_logprobs: bool,
    add_special_tokens: bool = True,
    images: list[str] | None = None,
) -> list[grpcclient.InferInput]:
    """The input tensors of one `llm` request, exactly as docs/interfaces.md names them."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("exactly one of prompt and input_ids must be given")
    tensors: list[tuple[str, np.ndarray, str]] = []
    if prompt is not None:
        tensors.append(("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"))
    else:
        tensors.append(("input_ids", np.asarray(input_ids, dtype=np.int32), "INT32"))
    tensors.append(("stream", np.array([stream], dtype=bool), "BOOL"))
    sampling_json = json.dumps(sampling_parameters).encode("utf-8")
    tensors.append(("sampling_parameters", np.array([sampling_json], dtype=np.object_), "BYTES"))
    # The prompt is never repeated in the output: callers that echo it prepend the text themselves.
    flags = {
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_logprobs": return_logprobs,
        "return_cumulative_logprob": return_logprobs,
        "add_special_tokens": add_special_tokens,
    }
    for name, value in flags.items():
        tensors.append((name, np.array([value], dtype=bool), "BOOL"))
    if images:  # base64 image files, in the prompt's placeholder order
        tensors.append(("image", np.array([image.encode("ascii") for image in images], dtype=np.object_), "BYTES"))
    inputs = []
    for name, array, dtype in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def parse_result(result: grpcclient.InferResult) -> LLMResponse | None:
    """Turn one streamed result into an LLMResponse; None for a response without outputs."""
    text = result.as_numpy("text_output")
    if text is None:
        return None
    reasons = result.as_numpy("finish_reason")
    logprobs = result.as_numpy("logprobs")
    cumulative = result.as_numpy("cumulative_logprob")
    num_input = result.as_numpy("num_input_tokens")
    num_output = result.as_numpy("num_output_tokens")
    output_ids = result.as_numpy("output_ids")
    prompt_logprobs = result.as_numpy("prompt_logprobs")
    return LLMResponse(
        text=[_decode(t) for t in text.reshape(-1)],
        finish_reason=[_decode(r) or None for r in reasons.reshape(-1)] if reasons is not None else [None] * text.size,
        num_input_tokens=int(num_input.reshape(-1)[0]) if num_input is not None else None,
        num_output_tokens=[int(x) for x in num_output.reshape(-1)] if num_output is not None else None,
        logprobs=[json.loads(_decode(x) or "[]") for x in logprobs.reshape(-1)] if logprobs is not None else None,
        cumulative_logprob=[float(x) for x in cumulative.reshape(-1)] if cumulative is not None else None,
        output_ids=[int(x) for x in output_ids.reshape(-1)] if output_ids is not None else None,
        prompt_logprobs=json.loads(_decode(prompt_logprobs.reshape(-1)[0])) if prompt_logprobs is not None else None,
    )


def _decode(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TritonLLMClient:
    """Async client of one tritonserver's `llm` model (gRPC, decoupled streaming)."""

    def __init__(self, url: str, model_name: str = LLM_MODEL):
        self.url = url
        self.model_name = model_name
        self._client = grpcclient.InferenceServerClient(url=url)

    async def close(self) -> None:
        """Close the gRPC channel."""
        await self._client.close()

    async def ready(self) -> bool:
        """True when the server and the `llm` model are ready."""
        try:
            return await self._client.is_server_ready() and await self._client.is_model_ready(self.model_name)
        except InferenceServerException:
            return False

    async def model_parameters(self) -> dict[str, str]:
        """The `parameters` of the model's config.pbtxt (e.g. `model_path`), as strings."""
        try:
            config = await self._client.get_model_config(self.model_name, as_json=True)
        except InferenceServerException as error:
            raise TritonUnavailableError(f"tritonserver at {self.url}: {error}") from error
        params = config.get("config", {}).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in params.items()}

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling_parameters: dict | None = None,
        stream: bool = True,
        return_logprobs: bool = False,
        request_id: str = "",
        add_special_tokens: bool = True,
        images: list[str] | None = None,
    ) -> AsyncIterator[LLMResponse]:
        """Send one request and yield its responses until every sequence has finished.

        Raises TritonRequestError when the server answers with an error and TritonUnavailableError
        when it cannot be reached. Leaving the loop early (break, exception, task cancellation)
        cancels the request on the server.
        """
        inputs = build_inputs(prompt, input_ids, sampling_parameters or {}, stream, return_logprobs,
                              add_special_tokens, images)

        async def requests():
            yield {"model_name": self.model_name, "inputs": inputs, "request_id": request_id}

        call = self._client.stream_infer(requests())
        request_ended = False  # the server sent the request's last response: it ends the stream by itself
        try:
            async for result, error in call:
                if error is not None:
                    request_ended = True  # an error response is the llm model's last
                    raise TritonRequestError(_strip_prefix(str(error)))
                response = parse_result(result)
                if response is None or not response.text:
                    continue
                # The last response of a request is the one where every sequence has a finish reason
                # (the aio client cannot ask for Triton's empty-final flag: the parameter is reserved).
                request_ended = response.finished
                yield response
                if request_ended:
                    break
        except grpc.aio.AioRpcError as error:
            raise TritonUnavailableError(f"tritonserver at {self.url}: {error.details()}") from error
        finally:
            await _end_stream(call, request_ended)


    async def pool(self, embedding_request: dict, request_id: str = "") -> tuple[list[float], int]:
        """Send one `embedding_request` ({"input": text or ids, "pooling_params": {...}[, "text_pair": text]});
        returns (the pooled vector, the input's token count); errors as generate() raises them."""
        array = np.array([json.dumps(embedding_request).encode("utf-8")], dtype=np.object_)
        tensor = grpcclient.InferInput("embedding_request", [1], "BYTES")
        tensor.set_data_from_numpy(array)

        async def requests():
            yield {"model_name": self.model_name, "inputs": [tensor], "request_id": request_id}

        call = self._client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise TritonRequestError(_strip_prefix(str(error)))
                vector = json.loads(_decode(result.as_numpy("text_output").reshape(-1)[0]))
                return vector, int(result.as_numpy("num_input_tokens").reshape(-1)[0])
        except grpc.aio.AioRpcError as error:
            raise TritonUnavailableError(f"tritonserver at {self.url}: {error.details()}") from error
        finally:
            await _end_stream(call, True)
        raise TritonUnavailableError(f"tritonserver at {self.url} ended an embedding_request without an answer")

    async def lora_control(self, control: dict) -> dict:
        """Send one lora_control request ({"action": "list" | "load" | "unload", ...}) and return its answer,
        {"message": ..., "lora_adapters": {name: folder}}; errors as generate() raises them."""
        array = np.array([json.dumps(control).encode("utf-8")], dtype=np.object_)
        tensor = grpcclient.InferInput("lora_control", [1], "BYTES")
        tensor.set_data_from_numpy(array)

        async def requests():
            yield {"model_name": self.model_name, "inputs": [tensor]}

        call = self._client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise TritonRequestError(_strip_prefix(str(error)))
                return json.loads(_decode(result.as_numpy("text_output").reshape(-1)[0]))
        except grpc.aio.AioRpcError as error:
            raise TritonUnavailableError(f"tritonserver at {self.url}: {error.details()}") from error
        finally:
            await _end_stream(call, True)
        raise TritonUnavailableError(f"tritonserver at {self.url} ended a lora_control stream without an answer")


async def _end_stream(call: Any, request_ended: bool) -> None:
    """End a stream_infer() call: read it to its end once its request has ended (at most
    STREAM_END_TIMEOUT_SECONDS), else cancel it, which cancels the request if it still runs on the server."""
    try:
        if request_ended:
            await asyncio.wait_for(_read_to_end(call), STREAM_END_TIMEOUT_SECONDS)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        pass
    finally:
        call.cancel()  # a no-op once the stream has ended


async def _read_to_end(call: Any) -> None:
    async for _ in call:
        pass


def _strip_prefix(message: str) -> str:
    """InferenceServerException's str() may start with a '[StatusCode...]' tag; users want the text."""
    if message.startswith("[") and "] " in message:
        return message.split("] ", 1)[1]
    return message
