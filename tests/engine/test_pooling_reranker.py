"""A causal LM served as a reranker by the logits of its "yes" and "no" tokens at the last token (Qwen3-Reranker,
as vLLM loads it with classifier_from_token / is_original_qwen3_reranker): scores equal transformers' next-token
softmax on the documented prompt."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model.config import UnsupportedModelError
from pagedserve.testing_pooling import make_tiny_qwen3_reranker, qwen3_reranker_pair

transformers = pytest.importorskip("transformers")

PAIRS = [qwen3_reranker_pair(q, d) for q, d in [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of France?", "The quick brown fox jumps over the lazy dog."),
    ("how are you", "I am fine, thank you very much."),
]]


def _reference(path) -> torch.Tensor:
    """transformers' next-token logits at each pair's last token: [pairs, (no, yes)]."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    rows = []
    with torch.no_grad():
        for query, document in PAIRS:
            ids = tokenizer(query + document, return_tensors="pt")["input_ids"]
            rows.append(model(ids).logits[0, -1, [no, yes]])
    return torch.stack(rows)


@pytest.mark.parametrize("tied", [True, False])
def test_original_qwen3_reranker_scores_equal_yes_probability(tmp_path, tied):
    path = make_tiny_qwen3_reranker(tmp_path / "reranker", tie_word_embeddings=tied)
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)
    assert engine.pooling.tasks == {"classify", "score"}
    scores = torch.tensor([o.pooled[0] for o in engine.encode(PAIRS, PoolingParams(task="score"))])
    expected = torch.softmax(_reference(path), dim=-1)[:, 1]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert expected.max() - expected.min() > 0.01  # the pairs score apart: the check can fail
    assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks


def test_token_classifier_without_two_way_gives_each_tokens_probability(tmp_path):
    path = make_tiny_qwen3_reranker(tmp_path / "reranker", original=False)
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)
    assert engine.pooling.labels == ("no", "yes")
    outputs = engine.encode(PAIRS, PoolingParams(task="classify"))
    torch.testing.assert_close(torch.tensor([o.pooled for o in outputs]), torch.softmax(_reference(path), dim=-1),
                               atol=1e-5, rtol=0)


def test_reranker_refuses_a_generate_request_and_bad_token_config(tmp_path):
    path = make_tiny_qwen3_reranker(tmp_path / "reranker")
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)
    with pytest.raises(InvalidRequestError) as caught:
        engine.encode(["hello"], PoolingParams(task="embed"))
    assert caught.value.field == "task"
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "classifier_from_token": ["no", "yes", "maybe"]}))
    with pytest.raises(UnsupportedModelError, match="two tokens"):
        LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)
    (path / "config.json").write_text(json.dumps({**config, "classifier_from_token": ["no", "absent-token"],
                                                  "is_original_qwen3_reranker": False}))
    with pytest.raises(UnsupportedModelError, match="absent-token"):
        LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)
