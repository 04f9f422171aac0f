"""The llm model's embedding_request input: what it parses to, and each bad form refused naming its field."""

from __future__ import annotations

import json

import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton.pooling_inputs import parse_embedding_request


def test_a_text_a_token_list_and_a_pair_parse_to_the_engine_fields():
    text, ids, pooling = parse_embedding_request(json.dumps({"input": "hello", "pooling_params": {"dimensions": 8}}))
    assert (text, ids, pooling.params.task, pooling.params.dimensions, pooling.text_pair) == ("hello", None, "embed",
                                                                                              8, None)
    text, ids, pooling = parse_embedding_request('{"input": [1, 2, 3]}')
    assert (text, ids) == (None, [1, 2, 3])
    body = {"input": "q", "text_pair": "doc", "pooling_params": {"task": "score", "activation": False}}
    text, _, pooling = parse_embedding_request(json.dumps(body))
    assert (text, pooling.text_pair, pooling.params.task, pooling.params.activation) == ("q", "doc", "score", False)


@pytest.mark.parametrize(("raw", "field"), [
    ("not json", "embedding_request"),
    ("[1]", "embedding_request"),
    ('{"input": ""}', "embedding_request.input"),
    ('{"input": []}', "embedding_request.input"),
    ('{"input": ["a", "b"]}', "embedding_request.input"),
    ('{"input": [1, true]}', "embedding_request.input"),
    ('{"input": "a", "extra": 1}', "embedding_request.extra"),
    ('{"input": [1], "text_pair": "b"}', "embedding_request.text_pair"),
    ('{"input": "a", "pooling_params": {"task": "generate"}}', "task"),
    ('{"input": "a", "pooling_params": {"dimensions": 0}}', "dimensions"),
    ('{"input": "a", "pooling_params": {"task": "score", "dimensions": 4}}', "dimensions"),
    ('{"input": "a", "pooling_params": {"normalize": "yes"}}', "normalize"),
    ('{"input": "a", "pooling_params": {"first_segment_tokens": 2}}',
     "embedding_request.pooling_params.first_segment_tokens"),
    ('{"input": "a", "pooling_params": "[]"}', "embedding_request.pooling_params"),
])
def test_bad_embedding_requests_are_refused_naming_the_field(raw, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_embedding_request(raw)
    assert err.value.field == field
