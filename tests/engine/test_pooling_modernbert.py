"""ModernBERT through LLMEngine (alternating global / windowed attention, two rotary bases, GeGLU): embeddings
equal sentence-transformers' encode, classifier scores equal CrossEncoder.predict and transformers' logits, on
tiny random folders whose window is shorter than the inputs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.testing_pooling import make_tiny_modernbert

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog and the capital of france is paris",
         "paged attention stores keys and values in fixed-size blocks; a block table maps positions to blocks",
         "42", "café, naïve, résumé, münchen, zürich"]
PAIRS = [("hello", "world"), ("a quick fox jumps over the lazy dog", "the capital of france is paris, once upon a "
                                                                     "time there was a small model"),
         ("zürich", "münchen and 中文 and more words to cross the window")]


def _engine(path) -> LLMEngine:
    return LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_modernbert_embeddings_equal_sentence_transformers(tmp_path, pooling):
    path = make_tiny_modernbert(tmp_path / "modernbert", pooling=pooling)
    engine = _engine(path)
    assert engine.pooling.tasks == {"embed"}
    outputs = engine.encode(TEXTS)
    assert max(len(o.prompt_token_ids) for o in outputs) > 20  # longer than the +-4 window
    reference = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    cosines = torch.nn.functional.cosine_similarity(torch.tensor([o.pooled for o in outputs]), reference)
    assert cosines.min() >= 0.9999
    assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("classifier_pooling", ["cls", "mean"])
def test_modernbert_classifier_equals_cross_encoder_and_transformers(tmp_path, classifier_pooling):
    path = make_tiny_modernbert(tmp_path / "modernbert", head="classify", classifier_pooling=classifier_pooling)
    engine = _engine(path)
    assert engine.pooling.tasks == {"classify", "score"}
    scores = torch.tensor([o.pooled[0] for o in engine.encode(PAIRS, PoolingParams(task="score"))])
    reference = torch.as_tensor(st.CrossEncoder(str(path), device="cpu").predict(PAIRS))
    torch.testing.assert_close(scores, reference, atol=1e-5, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.ModernBertForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = torch.cat([model(**tokenizer(a, b, return_tensors="pt")).logits[0] for a, b in PAIRS])
    torch.testing.assert_close(scores, torch.sigmoid(logits), atol=1e-5, rtol=0)
