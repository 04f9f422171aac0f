"""The llm model's `embedding_request` input (Triton's vLLM-backend name): one JSON object with `input` (a text
or a list of token ids), `pooling_params` (PoolingParams' fields) and, for a cross-encoder, `text_pair`. The
answer is the vector as JSON in `text_output`, with `num_input_tokens`."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.backend.core.errors import InvalidRequestError, json_object
from pagedserve.backend.core.pooling_params import PoolingParams

EMBEDDING_REQUEST = "embedding_request"
_FIELDS = ("input", "pooling_params", "text_pair")


@dataclass
class PoolingInputs:
    """A parsed embedding_request: the params and, for a text pair, its second text (the first is the prompt)."""

    params: PoolingParams
    text_pair: str | None = None


def parse_embedding_request(raw: str) -> tuple[str | None, list[int] | None, PoolingInputs]:
    """(prompt text, prompt token ids, PoolingInputs) of an embedding_request; bad input refused naming the field
    (`embedding_request.<key>`)."""
    body = json_object(raw, EMBEDDING_REQUEST)
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise InvalidRequestError(f"unknown {EMBEDDING_REQUEST} field {unknown[0]!r}; known: {list(_FIELDS)}",
                                  f"{EMBEDDING_REQUEST}.{unknown[0]}")
    value = body.get("input")
    text, ids = None, None
    if isinstance(value, str) and value:
        text = value
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        ids = list(value)
    else:
        raise InvalidRequestError(f"{EMBEDDING_REQUEST}.input must be a non-empty string or a non-empty list of "
                                  "token ids (one input a request)", f"{EMBEDDING_REQUEST}.input")
    pair = body.get("text_pair")
    if pair is not None and (not isinstance(pair, str) or not pair or text is None):
        raise InvalidRequestError(f"{EMBEDDING_REQUEST}.text_pair must be a non-empty string beside a text input",
                                  f"{EMBEDDING_REQUEST}.text_pair")
    params = PoolingParams.from_dict(body.get("pooling_params"), f"{EMBEDDING_REQUEST}.pooling_params")
    return text, ids, PoolingInputs(params, pair)
