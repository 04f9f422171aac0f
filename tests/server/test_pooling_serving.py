"""Pooling through tritonserver and the OpenAI shim: the official openai client's embeddings.create (float and
base64) equal sentence-transformers' encode, /pooling, /classify, /score and /rerank equal CrossEncoder.predict,
the embedding_request tensor over gRPC, /v1/models' capabilities, and bad input refused naming the field."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from pagedserve.testing_pooling import make_tiny_encoder, make_tiny_qwen3_reranker, qwen3_reranker_pair
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

st = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PARAMS = {**CPU_FP32, "max_model_len": "128", "max_num_batched_tokens": "256"}
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "Paged attention stores keys"]
DOCS = ["the lazy dog", "a quick brown fox", "Paged attention stores keys and values", "hello"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningTriton, str]]:
    work = tmp_path_factory.mktemp("embedder")
    path = make_tiny_encoder(work / "tiny-bert", "bert", pooling="mean")
    with triton_running(path, work, PARAMS, llm_only=True) as running, \
            running.openai_shim("--model-name", path.name) as url:
        yield running, url


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningTriton, str]]:
    work = tmp_path_factory.mktemp("reranker")
    path = make_tiny_encoder(work / "tiny-xlmr-reranker", "xlm_roberta", head="classify")
    # The inputs limit at the documents these tests send, so one more is refused.
    with triton_running(path, work, {**PARAMS, "max_pooling_inputs": str(len(DOCS))}, llm_only=True) as running, \
            running.openai_shim("--model-name", path.name) as url:
        yield running, url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_openai_embeddings_equal_sentence_transformers_in_float_and_base64(embedder):
    running, url = embedder
    model = running.model_path.name
    reference = st.SentenceTransformer(str(running.model_path), device="cpu").encode(TEXTS)
    client = _client(url)
    for fmt in ("float", "base64"):
        answer = client.embeddings.create(model=model, input=TEXTS, encoding_format=fmt)
        # Asked for base64, the client hands the string on as it came: little-endian float32.
        ours = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
                         for d in answer.data], dtype=np.float32)
        assert [d.index for d in answer.data] == [0, 1, 2]
        assert _cosine(ours, reference).min() >= 0.9999
    tokenizer = st.SentenceTransformer(str(running.model_path), device="cpu").tokenizer
    counts = [len(tokenizer(t)["input_ids"]) for t in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(counts)
    ids = tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=model, input=[ids])
    assert _cosine(np.array(by_ids.data[0].embedding), reference[0]) >= 0.9999


def test_models_say_what_the_model_does_and_generation_is_refused(embedder):
    running, url = embedder
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert cards[0]["capabilities"] == ["embed"]
    answer = httpx.post(f"{url}/v1/completions", json={"model": running.model_path.name, "prompt": "hi",
                                                       "max_tokens": 2})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "model"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[1, 100000]]}, "input"),
    ({"input": "word " * 200}, "input"),
    ({"input": ["a"] * 2049}, "input"),
])
def test_bad_embedding_input_is_refused_naming_the_field(embedder, body, param):
    running, url = embedder
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": running.model_path.name, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_an_embedding_model_scores_by_cosine_similarity(embedder):
    running, url = embedder
    reference = st.SentenceTransformer(str(running.model_path), device="cpu").encode(["quick fox", *DOCS])
    expected = _cosine(reference[:1], reference[1:])
    body = {"model": running.model_path.name, "query": "quick fox", "documents": DOCS}
    results = httpx.post(f"{url}/rerank", json=body).json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-5)


def test_embedding_request_tensor_over_grpc(embedder):
    running, _ = embedder
    reference = st.SentenceTransformer(str(running.model_path), device="cpu").encode([TEXTS[1]])[0]
    request = {"input": TEXTS[1], "pooling_params": {"task": "embed"}}
    result = running.grpc_stream("llm", {"embedding_request": json.dumps(request)})
    assert result.error is None
    vector = np.array(json.loads(result.texts()[-1]))
    assert _cosine(vector, reference) >= 0.9999
    assert int(result.outputs("num_input_tokens")[-1].reshape(-1)[0]) > 2
    bad = running.grpc_stream("llm", {"embedding_request": json.dumps({"input": "x", "pooling_params": {"dims": 2}})})
    assert bad.error is not None and "embedding_request.pooling_params.dims" in str(bad.error)


def test_rerank_score_and_classify_equal_cross_encoder(reranker):
    running, url = reranker
    model = running.model_path.name
    cross = st.CrossEncoder(str(running.model_path), device="cpu")
    query = "quick fox"
    expected = cross.predict([(query, d) for d in DOCS])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = httpx.post(f"{url}{path}", json={"model": model, "query": query, "documents": DOCS, "top_n": 2})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(-expected)[:2])
        np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1][:2], atol=1e-5)
        assert results[0]["document"]["text"] == DOCS[results[0]["index"]]
    scores = httpx.post(f"{url}/score", json={"model": model, "text_1": query, "text_2": DOCS}).json()["data"]
    np.testing.assert_allclose([s["score"] for s in scores], expected, atol=1e-5)
    classes = httpx.post(f"{url}/classify", json={"model": model, "input": DOCS[:2]}).json()["data"]
    assert [c["label"] for c in classes] == ["label_0", "label_0"] and classes[0]["num_classes"] == 1
    answer = httpx.post(f"{url}/rerank", json={"model": model, "query": query, "documents": DOCS, "top_n": 0})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_n"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["capabilities"] == ["classify", "score"]


def test_more_inputs_than_max_pooling_inputs_are_refused_naming_the_field(reranker):
    running, url = reranker
    model = running.model_path.name
    cases = [("/rerank", {"query": "q", "documents": [*DOCS, "one more"]}, "documents"),
             ("/score", {"text_1": "q", "text_2": [*DOCS, "one more"]}, "text_2"),
             ("/classify", {"input": [*DOCS, "one more"]}, "input")]
    for path, body, param in cases:
        answer = httpx.post(f"{url}{path}", json={"model": model, **body})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and "max_pooling_inputs" in error["message"]
    assert httpx.post(f"{url}/classify", json={"model": model, "input": DOCS}).status_code == 200


def test_cli_embed_prints_each_texts_embedding(embedder, capsys):
    from pagedserve.client.cli import main

    running, _ = embedder
    assert main(["embed", *TEXTS[:2], "--url", running.grpc_url]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    reference = st.SentenceTransformer(str(running.model_path), device="cpu").encode(TEXTS[:2])
    assert [line["text"] for line in lines] == TEXTS[:2]
    assert _cosine(np.array([line["embedding"] for line in lines]), reference).min() >= 0.9999
    assert main(["embed", "hi", "--dimensions", "8", "--url", running.grpc_url]) == 1
    assert "dimensions" in capsys.readouterr().err


def test_cli_rerank_prints_documents_best_first(reranker, capsys):
    from pagedserve.client.cli import main

    running, _ = reranker
    assert main(["rerank", "quick fox", *DOCS, "--top-n", "3", "--url", running.grpc_url]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    expected = st.CrossEncoder(str(running.model_path), device="cpu").predict([("quick fox", d) for d in DOCS])
    assert [int(r[1]) for r in rows] == list(np.argsort(-expected)[:3])
    assert [r[2] for r in rows] == [DOCS[int(r[1])] for r in rows]


def test_qwen3_reranker_ranks_by_the_yes_probability_over_http(tmp_path_factory):
    import torch
    import transformers

    work = tmp_path_factory.mktemp("qwen3-reranker")
    path = make_tiny_qwen3_reranker(work / "tiny-qwen3-reranker")
    query, docs = qwen3_reranker_pair("quick fox", "")[0], [qwen3_reranker_pair("", d)[1] for d in DOCS]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        logits = [model(tokenizer(query + d, return_tensors="pt")["input_ids"]).logits[0, -1, [no, yes]] for d in docs]
    expected = torch.stack(logits).softmax(-1)[:, 1].numpy()
    with triton_running(path, work, {**PARAMS, "max_model_len": "256"}, llm_only=True) as running, \
            running.openai_shim("--model-name", path.name) as url:
        answer = httpx.post(f"{url}/rerank", json={"model": path.name, "query": query, "documents": docs})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["index"] for r in results] == list(np.argsort(-expected))
        np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-5)
        scores = httpx.post(f"{url}/score", json={"model": path.name, "text_1": query, "text_2": docs}).json()
        np.testing.assert_allclose([s["score"] for s in scores["data"]], expected, atol=1e-5)
