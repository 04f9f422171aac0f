"""Turning one engine output into the llm model's response tensors (text, finish reasons, logprobs JSON,
counts, and the ids the ensemble's postprocessing step decodes)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.backend.core.outputs import CompletionOutput, RequestOutput
from pagedserve.backend.engine.detokenizer import detokenize_incrementally, initial_offsets
from pagedserve.backend.triton.inputs import LLMRequestInputs
from pagedserve.backend.triton.messages import InFlight
from pagedserve.backend.triton.tensors import string_tensor


class OutputEncoder:
    """Response tensors of the llm model; stateless but for each request's offsets in its InFlight."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def tensors(self, request: InFlight, output: RequestOutput) -> list:
        """Every output tensor this request asked for, for this output."""
        inputs = request.inputs
        if inputs.pooling is not None:  # the vector as JSON text, as Triton's vLLM backend answers it
            return [string_tensor("text_output", [json.dumps(output.pooled)] if output.pooled is not None else [""]),
                    *self._counts(inputs, output)]
        completions = output.outputs
        if inputs.stream:
            texts = [c.text_delta for c in completions]
        else:
            echo = "" if inputs.exclude_input_in_output else self._prompt_text(output)
            texts = [echo + c.text for c in completions]
        tensors = [string_tensor("text_output", texts)]
        ensemble = inputs.from_ensemble
        if ensemble:
            tensors += self._ensemble_tensors(request, output)
        if inputs.return_finish_reason or ensemble:
            tensors.append(string_tensor("finish_reason", [c.finish_reason or "" for c in completions]))
        if inputs.return_cumulative_logprob or ensemble:
            values = [c.cumulative_logprob or 0.0 for c in completions]
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.asarray(values, dtype=np.float32)))
        if inputs.return_logprobs or ensemble:
            entries = [json.dumps(self._logprob_entries(c, inputs), ensure_ascii=False) for c in completions]
            tensors.append(string_tensor("logprobs", entries))
        tensors += self._counts(inputs, output)
        if inputs.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            # Complete once the prompt is prefilled, which is before the request's first response.
            request.prompt_logprobs_sent = True
            entries = self._prompt_logprob_entries(output, inputs.params.prompt_logprobs)
            tensors.append(string_tensor("prompt_logprobs", [json.dumps(entries, ensure_ascii=False)]))
        return tensors

    @staticmethod
    def _counts(inputs: LLMRequestInputs, output: RequestOutput) -> list:
        tensors = []
        if inputs.return_num_input_tokens:
            tensors.append(pb_utils.Tensor("num_input_tokens",
                                           np.asarray([len(output.prompt_token_ids)], dtype=np.int32)))
        if inputs.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens",
                                           np.asarray([len(c.token_ids) for c in output.outputs], dtype=np.int32)))
        return tensors

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self._tokenizer.decode(output.prompt_token_ids, skip_special_tokens=True)

    def _ensemble_tensors(self, request: InFlight, output: RequestOutput) -> list:
        """`output_ids` plus the preceding ids and read offset postprocessing needs to decode statelessly."""
        completion = output.outputs[0]
        inputs = request.inputs
        prompt_ids = inputs.prompt_token_ids
        generated = list(completion.token_ids_delta if inputs.stream else completion.token_ids)
        if (completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
                and not inputs.params.include_stop_str_in_output and generated):
            generated.pop()  # the eos or stop token (end_id) that ended it: not in the text, as in text_output
        if not request.token_ids:
            request.token_ids = list(prompt_ids)
            request.prefix_offset, request.read_offset = initial_offsets(len(prompt_ids))
        if inputs.stream:
            prefix_ids, read_offset = self._advance(request, generated)
            output_ids = generated
        elif inputs.exclude_input_in_output:
            prefix_ids = prompt_ids[request.prefix_offset:]
            read_offset = len(prefix_ids)
            output_ids = generated
        else:
            prefix_ids, read_offset, output_ids = [], 0, list(prompt_ids) + generated
        return [
            pb_utils.Tensor("output_ids", np.asarray(output_ids, dtype=np.int32)),
            pb_utils.Tensor("prefix_ids", np.asarray(prefix_ids, dtype=np.int32)),
            pb_utils.Tensor("read_offset", np.asarray([read_offset], dtype=np.int32)),
        ]

    def _advance(self, request: InFlight, new_ids: list[int]) -> tuple[list[int], int]:
        """Streamed ensemble text: (the ids before `new_ids` that decoding needs, the read offset in them);
        the request's offsets move past `new_ids`."""
        before = len(request.token_ids)
        request.token_ids.extend(new_ids)
        prefix_ids = request.token_ids[request.prefix_offset:before]
        read_offset = request.read_offset - request.prefix_offset
        _, request.prefix_offset, request.read_offset = detokenize_incrementally(
            self._tokenizer, request.token_ids, request.prefix_offset, request.read_offset,
            request.inputs.params.skip_special_tokens,
        )
        return prefix_ids, read_offset

    def _logprob_entries(self, completion: CompletionOutput, inputs: LLMRequestInputs) -> list[dict]:
        """The logprobs JSON of this response's tokens: all of them, or the new ones when streaming."""
        if not completion.logprobs:
            return []
        count = len(completion.token_ids_delta) if inputs.stream else len(completion.token_ids)
        token_ids = completion.token_ids[len(completion.token_ids) - count:]
        per_token = completion.logprobs[len(completion.logprobs) - count:] if count else []
        return [self._token_entry(token_id, candidates, inputs.params.logprobs or 0)
                for token_id, candidates in zip(token_ids, per_token, strict=True)]

    def _prompt_logprob_entries(self, output: RequestOutput, top_n: int) -> list[dict]:
        """The `prompt_logprobs` JSON: one entry per prompt token; the first, which nothing precedes, has
        null `logprob` and `top_logprobs`."""
        entries = []
        for token_id, candidates in zip(output.prompt_token_ids, output.prompt_logprobs, strict=True):
            if candidates is None:
                entries.append({"token_id": token_id, "token": self._tokenizer.decode([token_id]),
                                "logprob": None, "top_logprobs": None})
            else:
                entries.append(self._token_entry(token_id, candidates, top_n))
        return entries

    def _token_entry(self, token_id: int, candidates: dict[int, float], top_n: int) -> dict:
        decode = self._tokenizer.decode
        ranked = sorted(candidates.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        return {
            "token_id": token_id,
            "token": decode([token_id]),
            "logprob": candidates.get(token_id, float("nan")),
            "top_logprobs": [{"token_id": t, "token": decode([t]), "logprob": lp} for t, lp in ranked],
        }
