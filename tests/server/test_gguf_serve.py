"""`pagedserve serve --model file.gguf`: the llm model serves the file itself, and the models that read a
tokenizer folder (the ensemble's steps, the OpenAI shim) get one made from the file's own metadata."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from pagedserve.backend.model.gguf_tokenizer import tokenizer_dir
from pagedserve.client.model_repository import DEFAULT_MODEL_REPOSITORY, prepare_model_repository
from tests.support import tiny_gguf
from tests.support.servers import CPU_FP32, triton_running

TEXT = "Hello world! The capital of France is Paris. Café ✓"


def _quantizer(name, w):
    from pagedserve.kernels import quant_linear as ql

    return ql.quantize_int8(w, 32) if "embed" in name else ql.quantize_int4(w, 32)


@pytest.fixture(scope="module")
def tiny_gguf_file(tiny_tied_path, tmp_path_factory):
    return tiny_gguf.write_model_gguf(tiny_tied_path, tmp_path_factory.mktemp("gguf") / "tiny.gguf", _quantizer)


def test_the_tokenizer_folder_of_a_gguf_tokenizes_as_its_source_and_keeps_its_config(tiny_gguf_file,
                                                                                      tiny_tied_path, tmp_path):
    folder = tokenizer_dir(tiny_gguf_file, str(tmp_path))
    source = AutoTokenizer.from_pretrained(str(tiny_tied_path))
    made = AutoTokenizer.from_pretrained(str(folder))
    assert made(TEXT)["input_ids"] == source(TEXT)["input_ids"]
    assert made.chat_template == source.chat_template
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == json.loads((tiny_tied_path / "config.json").read_text())["hidden_size"]
    assert tokenizer_dir(tiny_gguf_file, str(tmp_path)) == folder  # made once


def test_a_gguf_model_repository_serves_the_file_and_tokenizes_from_its_folder(tiny_gguf_file, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "models", str(tiny_gguf_file))
    llm = (repository / "llm" / "config.pbtxt").read_text()
    assert f'string_value: "{tiny_gguf_file}"' in llm
    folder = tokenizer_dir(tiny_gguf_file, str(tmp_path / "cache"))
    for step in ("preprocessing", "postprocessing", "ensemble"):
        assert f'string_value: "{folder}"' in (repository / step / "config.pbtxt").read_text()


@pytest.mark.slow
def test_the_default_q4_1_gguf_served_natively_answers_paris_through_the_ensemble_and_the_shim(tmp_path):
    from pagedserve.backend.model.default_model import find_gguf

    params = {**CPU_FP32, "max_model_len": "512", "kv_cache_memory_bytes": str(64 << 20)}
    with triton_running(find_gguf(), tmp_path, params) as server:
        answer = server.generate("ensemble", {"text_input": "The capital of France is", "max_tokens": 8,
                                              "temperature": 0.0})
        assert "Paris" in answer["text_output"], answer
        with server.openai_shim("--model", str(find_gguf())) as url:  # as `pagedserve serve` starts it
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            (model,) = client.models.list()
            chat = client.chat.completions.create(
                model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=12, temperature=0)
    assert model.id == find_gguf().name
    assert "Paris" in chat.choices[0].message.content
