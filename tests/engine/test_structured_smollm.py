"""Structured outputs on the default model (SmolLM2-135M-Instruct): a real model under a JSON schema still
answers the question, and its answer validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.backend.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
QUESTION = "What is the capital of France? Answer in JSON with city, country and population."


@pytest.fixture(scope="module")
def smollm_engine():
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.backend.model.default_model import ensure_default_model

    return LLMEngine.from_pretrained(ensure_default_model(), dtype="float32", kv_cache_memory_bytes=64 << 20)


def _chat_prompt(engine, question: str) -> list[int]:
    """The question in the model's chat template, as token ids: the template writes its own special tokens."""
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                add_generation_prompt=True, tokenize=False)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_chat_answer_under_a_json_schema_validates_and_names_paris(smollm_engine):
    params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs={"json": CITY_SCHEMA})
    (out,) = smollm_engine.generate([_chat_prompt(smollm_engine, QUESTION)], params)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion.text
    answer = json.loads(completion.text)
    jsonschema.validate(answer, CITY_SCHEMA)
    assert "Paris" in answer["city"], answer
