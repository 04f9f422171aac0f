"""Chat templates rendered as transformers renders them, in a sandbox (no server needed)."""

from __future__ import annotations

import json

import pytest

from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.openai.errors import APIError


def test_chat_template_renders_like_transformers(tmp_path):
    from pagedserve.testing import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 🙂"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_model_dir(tmp_path).render(messages) == expected


def test_chat_template_from_tokenizer_config_json(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "hi"}])
    assert rendered == "<s>[user]hi</s>"


def test_chat_template_is_sandboxed_and_errors_name_messages():
    mutating = ChatTemplate("{{ messages.append({'role': 'x'}) }}")
    with pytest.raises(APIError) as info:
        mutating.render([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"
    raising = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(APIError, match="only user turns"):
        raising.render([{"role": "user", "content": "hi"}])


def test_model_folder_without_template_is_reported(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        ChatTemplate.from_model_dir(tmp_path)

