"""vLLM's chat options: add_generation_prompt, continue_final_message and chat_template_kwargs render as
transformers' apply_chat_template renders them; bad options are refused naming the field (no server)."""

from __future__ import annotations

import pytest

from pagedserve.client.openai.chat_template import ChatTemplate
from pagedserve.client.openai.errors import APIError
from pagedserve.client.openai.protocol import parse_chat_request

CONTINUED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is "}]
# A template reading a kwarg, as Qwen3's reads enable_thinking.
THINKING = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if not enable_thinking %}<no_think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pagedserve.testing import build_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder)
    return tokenizer, ChatTemplate.from_model_dir(folder)


def test_continue_final_message_ends_inside_the_assistant_turn_as_transformers(tokenizer):
    hf, ours = tokenizer
    expected = hf.apply_chat_template(CONTINUED, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    assert ours.render(CONTINUED, False, continue_final_message=True) == expected
    assert expected.endswith("My answer is ")


def test_without_a_generation_prompt_as_transformers(tokenizer):
    hf, ours = tokenizer
    messages = CONTINUED[:1]
    assert ours.render(messages, False) == hf.apply_chat_template(messages, tokenize=False,
                                                                  add_generation_prompt=False)


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tokenizer):
    hf, _ = tokenizer
    messages = CONTINUED[:1]
    ours = ChatTemplate(THINKING)
    for thinking in (True, False):
        expected = hf.apply_chat_template(messages, chat_template=THINKING, tokenize=False,
                                          add_generation_prompt=True, enable_thinking=thinking)
        assert ours.render(messages, True, enable_thinking=thinking) == expected


BODY = {"model": "m", "messages": CONTINUED}


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default generation prompt
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": CONTINUED[:1]}, "continue_final_message"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"echo": 1}, "echo"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_bad_chat_options_are_refused_naming_the_field(extra, param):
    with pytest.raises(APIError) as info:
        parse_chat_request({**BODY, **extra})
    assert info.value.status == 400 and info.value.param == param


def test_a_template_that_drops_the_final_message_cannot_be_continued():
    with pytest.raises(APIError) as info:
        ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}").render(
            CONTINUED, False, continue_final_message=True)
    assert info.value.param == "continue_final_message"
