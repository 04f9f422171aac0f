"""logit_bias, allowed_token_ids and bad_words: the sampler obeys each, on constructed logits and through the
engine; bad values are refused naming the field; rows without them are untouched."""

from __future__ import annotations

import re

import pytest
import torch

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.worker.logits_processors import apply_logits_processors
from pagedserve.backend.worker.sampler import Sampler
from tests.support.engines import cpu_engine

VOCAB = 64


def _request(params: SamplingParams, output=()) -> Request:
    request = Request("r", [1, 2, 3], params)
    for token in output:
        request.append_output_token_id(token)
    return request


def test_allowed_token_ids_bound_every_draw():
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 9, 40])
    logits = torch.randn(256, VOCAB, generator=torch.Generator().manual_seed(0))
    out = Sampler({63})(logits, [_request(params) for _ in range(256)])
    assert set(out.token_ids) <= {3, 9, 40} and len(set(out.token_ids)) == 3


def test_logit_bias_adds_to_the_logits_and_leaves_the_input_alone():
    logits = torch.zeros(1, VOCAB)
    biased, rows = apply_logits_processors(logits, [_request(SamplingParams(logit_bias={"5": 2.5, 7: -1}))])
    assert rows == {0} and biased[0, 5] == 2.5 and biased[0, 7] == -1 and biased[0, 6] == 0
    assert torch.count_nonzero(logits) == 0


def test_a_bad_word_bans_its_last_token_only_after_its_other_tokens():
    params = SamplingParams(bad_words=["x"])
    params.bad_words_token_ids = [[4], [10, 11, 12]]
    logits = torch.zeros(2, VOCAB)
    out, _ = apply_logits_processors(logits, [_request(params, output=[9, 10, 11]), _request(params, [10, 12])])
    assert out[0, 4] == out[0, 12] == -float("inf") and out[0, 11] == 0
    assert out[1, 4] == -float("inf") and out[1, 12] == 0


@pytest.mark.parametrize(("field", "value", "message"), [
    ("logit_bias", {"5": 101}, "biases must be in [-100, 100]"),
    ("logit_bias", {"five": 1}, "token ids must be integers"),
    ("logit_bias", [1, 2], "must be an object"),
    ("allowed_token_ids", [], "must be a non-empty list"),
    ("allowed_token_ids", [1, -2], "token ids must be integers >= 0"),
    ("bad_words", ["ok", " "], "non-blank strings"),
    ("bad_words", 5, "must be a list"),
])
def test_bad_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        SamplingParams.from_dict({field: value})
    assert info.value.field == field


def test_the_engine_filled_token_ids_are_not_a_request_field():
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter 'bad_words_token_ids'"):
        SamplingParams.from_dict({"bad_words_token_ids": [[1]]})


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return cpu_engine(tiny_llama_path, num_blocks=64, max_model_len=256)


GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def _tokens(engine, **params) -> list[int]:
    return engine.generate("The story", SamplingParams(**{**GREEDY, **params}))[0].outputs[0].token_ids


def test_token_ids_beyond_the_vocabulary_are_refused(engine):
    for field, value in (("logit_bias", {engine.vocab_size: 1.0}), ("allowed_token_ids", [engine.vocab_size])):
        with pytest.raises(InvalidRequestError, match="vocabulary size") as info:
            engine.add_request("too-big", "Hi", SamplingParams(**{field: value}))
        assert info.value.field == field
    assert not engine.has_unfinished_requests()


def test_logit_bias_steers_and_bans_greedy_tokens(engine):
    plain = _tokens(engine)
    assert _tokens(engine, logit_bias={"17": 100}) == [17] * GREEDY["max_tokens"]
    banned = _tokens(engine, logit_bias={plain[0]: -100})
    assert plain[0] not in banned


def test_bad_words_never_appear_and_neighbours_are_untouched(engine):
    plain = engine.generate("The story", SamplingParams(**GREEDY))[0]
    # A word of two output tokens that tokenizes back to them: the ban is then of a sequence the model wrote.
    tokens = plain.outputs[0].token_ids
    word = next(text for i in range(len(tokens) - 1)
                if (text := engine.tokenizer.decode(tokens[i:i + 2])).strip() == text and text
                and engine.tokenizer.encode(text, add_special_tokens=False) == tokens[i:i + 2])
    params = [SamplingParams(**GREEDY, bad_words=[word]), SamplingParams(**GREEDY)]
    guarded, neighbour = engine.generate(["The story", "The story"], params)
    assert neighbour.outputs[0].token_ids == plain.outputs[0].token_ids
    for sequence in params[0].bad_words_token_ids:
        tokens = guarded.outputs[0].token_ids
        assert all(tokens[i:i + len(sequence)] != sequence for i in range(len(tokens)))
    assert guarded.outputs[0].token_ids != plain.outputs[0].token_ids
