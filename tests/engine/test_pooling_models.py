"""Encoder families (BERT, XLM-RoBERTa) and their classifier heads, one forward over a flat batch of whole
sequences, against sentence-transformers' encode and CrossEncoder.predict on tiny random folders."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend.model import load_model
from pagedserve.backend.model.attention import AttentionMetadata
from pagedserve.backend.model.pooler import pool_rows as pool
from pagedserve.backend.model.pooler import read_pooling_config
from pagedserve.testing_pooling import make_tiny_encoder

st = pytest.importorskip("sentence_transformers")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "Paged attention stores keys", "42"]
PAIRS = [("hello", "world"), ("a quick fox", "the lazy dog jumps"), ("Zürich", "München, 中文")]


def _forward(path, encodings):
    """The model's flat forward over the encodings' sequences: (model, hidden [T, H], starts, lengths)."""
    model = load_model(path, torch.float32, torch.device("cpu"), 128)
    seqs = encodings["input_ids"]
    lens = [len(s) for s in seqs]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata(positions, torch.zeros(len(lens), 1, dtype=torch.int32),
                             torch.tensor([*starts, sum(lens)], dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), max(lens), max(lens))
    types = encodings.get("token_type_ids")
    kwargs = {} if types is None else {"token_type_ids": torch.tensor([t for s in types for t in s])}
    with torch.inference_mode():
        hidden = model(torch.tensor([t for s in seqs for t in s]), positions, [], meta, **kwargs)
    return model, hidden, starts, lens


@pytest.mark.parametrize("family", ["bert", "xlm_roberta"])
@pytest.mark.parametrize("pooling", ["cls", "mean", "lasttoken"])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path, family, pooling):
    path = make_tiny_encoder(tmp_path / family, family, pooling=pooling)
    ref_model = st.SentenceTransformer(str(path), device="cpu")
    ref = ref_model.encode(TEXTS, convert_to_tensor=True)
    model, hidden, starts, lens = _forward(str(path), ref_model.tokenizer(TEXTS))
    config = read_pooling_config(path, model.default_pooling, False)
    assert (config.pooling_type, config.normalize) == (pooling, True)
    ours = torch.nn.functional.normalize(pool(hidden, starts, lens, config.pooling_type), dim=-1)
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.9999


@pytest.mark.parametrize("family", ["bert", "xlm_roberta"])
def test_encoder_classifier_equals_cross_encoder(tmp_path, family):
    path = make_tiny_encoder(tmp_path / family, family, head="classify")
    ref_model = st.CrossEncoder(str(path), device="cpu")
    ref = torch.as_tensor(ref_model.predict(PAIRS))
    encodings = ref_model.tokenizer([a for a, _ in PAIRS], [b for _, b in PAIRS])
    if family == "bert":
        assert any(1 in types for types in encodings["token_type_ids"])  # the pair's second segment is type 1
    model, hidden, starts, lens = _forward(str(path), encodings)
    with torch.inference_mode():
        scores = torch.sigmoid(model.pooling_head(pool(hidden, starts, lens, "cls"))).flatten()
    torch.testing.assert_close(scores, ref, atol=1e-5, rtol=0)
