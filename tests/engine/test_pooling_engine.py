"""Pooling requests through LLMEngine: encoder and decoder embeddings equal sentence-transformers' encode,
classifier scores equal CrossEncoder.predict, pooled requests share steps with generating ones without
changing them, blocks all come back, and bad input is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.backend.core.errors import ConfigError, InvalidRequestError
from pagedserve.backend.core.pooling_params import PoolingParams
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.testing_pooling import (
    make_tiny_decoder_classifier,
    make_tiny_decoder_embedding,
    make_tiny_encoder,
)

st = pytest.importorskip("sentence_transformers")

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "Paged attention stores keys and values",
         "42", "Café, naïve, résumé, München"]
PAIRS = [("hello", "world"), ("a quick fox", "the lazy dog jumps"), ("Zürich", "München, 中文 and more")]


def _engine(path, **kwargs) -> LLMEngine:
    return LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=128, **kwargs)


def _cosines(outputs, reference) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor([o.pooled for o in outputs]), reference)


def _all_blocks_free(engine: LLMEngine) -> bool:
    return engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize(("family", "pooling"), [("bert", "cls"), ("bert", "mean"), ("xlm_roberta", "cls"),
                                                 ("xlm_roberta", "mean")])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path, family, pooling):
    path = make_tiny_encoder(tmp_path / family, family, pooling=pooling)
    engine = _engine(path)
    assert engine.pooling.tasks == {"embed"}
    outputs = engine.encode(TEXTS)
    reference = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert _cosines(outputs, reference).min() >= 0.9999
    assert all(abs(torch.tensor(o.pooled).norm() - 1) < 1e-5 for o in outputs)
    assert _all_blocks_free(engine) and not engine.has_unfinished_requests()


@pytest.mark.parametrize(("arch", "pooling"), [("qwen3", "lasttoken"), ("qwen3", "mean"), ("llama", "lasttoken"),
                                               ("qwen2", "mean")])
def test_decoder_embeddings_equal_sentence_transformers(tmp_path, arch, pooling):
    path = make_tiny_decoder_embedding(tmp_path / arch, arch, pooling=pooling)
    # Last-token pooling may run in chunks; mean pooling runs each input whole.
    engine = _engine(path, max_num_batched_tokens=16 if pooling == "lasttoken" else 64)
    outputs = engine.encode(TEXTS[:3] + [TEXTS[2]])  # the repeat may hit the cache's blocks
    reference = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS[:3] + [TEXTS[2]], convert_to_tensor=True)
    assert _cosines(outputs, reference).min() >= 0.9999
    assert _all_blocks_free(engine)


@pytest.mark.parametrize("kind", ["bert", "xlm_roberta", "qwen3"])
def test_classifier_scores_equal_cross_encoder(tmp_path, kind):
    if kind == "qwen3":
        path = make_tiny_decoder_classifier(tmp_path / kind)
    else:
        path = make_tiny_encoder(tmp_path / kind, kind, head="classify")
    engine = _engine(path)
    assert engine.pooling.tasks == {"classify", "score"}
    scores = [o.pooled[0] for o in engine.encode(PAIRS, PoolingParams(task="score"))]
    reference = st.CrossEncoder(str(path), device="cpu").predict(PAIRS)
    torch.testing.assert_close(torch.tensor(scores), torch.as_tensor(reference), atol=1e-5, rtol=0)
    assert _all_blocks_free(engine)


def test_multi_label_classifier_gives_softmax_probabilities(tmp_path):
    path = make_tiny_encoder(tmp_path / "bert", "bert", head="classify", num_labels=3)
    engine = _engine(path)
    assert engine.pooling.labels == ("label_0", "label_1", "label_2")
    probs = torch.tensor(engine.encode(PAIRS[:1])[0].pooled)
    logits = torch.tensor(engine.encode(PAIRS[:1], PoolingParams(task="classify", activation=False))[0].pooled)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    reference = st.CrossEncoder(str(path), device="cpu").predict(PAIRS[:1], apply_softmax=True)
    torch.testing.assert_close(probs, torch.as_tensor(reference[0]), atol=1e-5, rtol=0)


def test_matryoshka_dimensions_truncate_then_normalise(tmp_path):
    path = make_tiny_decoder_embedding(tmp_path / "qwen3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    engine = _engine(path)
    outputs = engine.encode(TEXTS[:2], PoolingParams(dimensions=32))
    reference = st.SentenceTransformer(str(path), device="cpu", truncate_dim=32).encode(TEXTS[:2],
                                                                                         convert_to_tensor=True)
    assert len(outputs[0].pooled) == 32
    assert _cosines(outputs, reference).min() >= 0.9999
    with pytest.raises(InvalidRequestError) as err:
        engine.add_pooling_request("r", "hi", PoolingParams(dimensions=48))
    assert err.value.field == "dimensions"


def test_pooled_requests_share_steps_with_generation_without_changing_it(tmp_path):
    path = make_tiny_decoder_embedding(tmp_path / "qwen3")
    engine = _engine(path, runner="all", max_num_batched_tokens=24)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in engine.generate(TEXTS[:3], greedy)]
    for i, text in enumerate(TEXTS[:3]):
        engine.add_request(f"gen-{i}", text, greedy)
        engine.add_pooling_request(f"emb-{i}", TEXTS[-1 - i])
    final, steps_mixed = {}, 0
    while engine.has_unfinished_requests():
        sched_before = engine.scheduler.num_running
        outputs = engine.step()
        steps_mixed += sched_before > 0 and any(o.pooled is not None for o in outputs)
        final.update((o.request_id, o) for o in outputs if o.finished)
    assert steps_mixed  # a pooled request finished in a step while generation ran
    assert [final[f"gen-{i}"].outputs[0].token_ids for i in range(3)] == alone
    reference = st.SentenceTransformer(str(path), device="cpu").encode([TEXTS[-1 - i] for i in range(3)],
                                                                       convert_to_tensor=True)
    assert _cosines([final[f"emb-{i}"] for i in range(3)], reference).min() >= 0.9999
    assert _all_blocks_free(engine)


def test_encoder_requests_run_whole_in_one_step(tmp_path):
    path = make_tiny_encoder(tmp_path / "bert", "bert", pooling="mean")
    engine = _engine(path, max_num_batched_tokens=20)
    texts = TEXTS * 3
    for i, text in enumerate(texts):
        engine.add_pooling_request(f"r{i}", text)
    lengths = {f"r{i}": len(engine.tokenizer(t)["input_ids"]) for i, t in enumerate(texts)}
    done = 0
    while engine.has_unfinished_requests():
        sched = engine.core.schedule()
        assert all(s.num_scheduled_tokens == lengths[s.request.request_id] for s in sched.scheduled)
        assert sched.total_num_scheduled_tokens <= 20
        engine._run(sched)
        done += sum(o.finished for o in engine.output.collect())
    assert done == len(texts) and _all_blocks_free(engine)


def test_bad_pooling_input_is_refused_naming_the_field(tmp_path):
    path = make_tiny_encoder(tmp_path / "bert", "bert")
    engine = _engine(path, max_num_batched_tokens=32)
    cases = [
        (lambda: engine.add_request("g", "hello"), "task"),
        (lambda: engine.add_pooling_request("a", "hi", PoolingParams(task="classify")), "task"),
        (lambda: engine.add_pooling_request("b", "hi", PoolingParams(dimensions=8)), "dimensions"),
        (lambda: engine.add_pooling_request("c", None, prompt_token_ids=[1, 10_000]), "prompt_token_ids"),
        (lambda: engine.add_pooling_request("d", None, prompt_token_ids=[]), "prompt_token_ids"),
        (lambda: engine.add_pooling_request("e", "word " * 40), "input"),
        (lambda: engine.add_pooling_request("f", ""), "prompt"),
        (lambda: PoolingParams(task="generate"), "task"),
        (lambda: PoolingParams.from_dict('{"normalise": true}'), "pooling_params.normalise"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert err.value.field == field
    assert not engine.has_unfinished_requests()
    with pytest.raises(ConfigError) as err:
        _engine(path, runner="generate")
    assert err.value.field == "runner"
    with pytest.raises(ConfigError) as err:  # past the encoder's learned positions
        LLMEngine.from_pretrained(str(path), dtype="float32", max_model_len=256)
    assert err.value.field == "max_model_len"
    generator = _engine(make_tiny_decoder_embedding(tmp_path / "qwen3"), runner="generate")
    with pytest.raises(InvalidRequestError) as err:
        generator.add_pooling_request("x", "hello")
    assert err.value.field == "task"


def test_the_folders_instruction_prompts_go_before_the_input(tmp_path):
    path = make_tiny_decoder_embedding(tmp_path / "qwen3", pooling="mean")
    prompts = {"query": "Instruct: find the passage\nQuery: ", "document": ""}
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts,
                                                                       "default_prompt_name": None}))
    engine = _engine(path)
    reference = st.SentenceTransformer(str(path), device="cpu")
    ours = engine.encode(TEXTS[:2], PoolingParams(prompt_name="query"))
    assert _cosines(ours, reference.encode(TEXTS[:2], prompt_name="query", convert_to_tensor=True)).min() >= 0.9999
    plain = engine.encode(TEXTS[:2])
    assert _cosines(plain, reference.encode(TEXTS[:2], convert_to_tensor=True)).min() >= 0.9999
    assert len(ours[0].prompt_token_ids) > len(plain[0].prompt_token_ids)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_pooling_request("r", "hi", PoolingParams(prompt_name="passage"))
    assert err.value.field == "prompt_name"
