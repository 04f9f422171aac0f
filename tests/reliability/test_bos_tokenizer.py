"""A model whose tokenizer adds a BOS of its own and whose chat template starts with `{{ bos_token }}`
(Llama's and Mistral's do): chat prompts through the OpenAI shim carry one BOS, the template's, exactly the
ids transformers' `apply_chat_template` gives; plain completions keep the tokenizer's BOS."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.testing import copy_with_bos_tokenizer
from tests.support.servers import CPU_FP32, triton_running

pytestmark = pytest.mark.slow

PARAMS = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def bos_model(tiny_llama_path, tmp_path_factory):
    return copy_with_bos_tokenizer(tiny_llama_path, tmp_path_factory.mktemp("bos") / "model")


@pytest.fixture(scope="module")
def bos_shim(bos_model, tmp_path_factory):
    with triton_running(bos_model, tmp_path_factory.mktemp("bos-triton"), PARAMS, llm_only=True) as running:
        with running.openai_shim("--model-name", "bos") as url:
            yield url


def _answer(shim_url: str, path: str, body: dict) -> dict:
    """The shim's JSON answer (its usage and, with echo + logprobs, the prompt tokens the engine used)."""
    reply = httpx.post(f"{shim_url}{path}", json={"model": "bos", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_chat_prompt_has_one_bos_like_transformers(bos_model, bos_shim):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bos_model))
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert expected[0] == tokenizer.bos_token_id and expected[1] != tokenizer.bos_token_id
    chat = _answer(bos_shim, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(expected)

    # The same rendered text as a completion: the tokenizer's own BOS comes on top, unless turned off.
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    body = {"prompt": rendered, "max_tokens": 1, "echo": True, "logprobs": 0}
    plain = _answer(bos_shim, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]
    bare = _answer(bos_shim, "/v1/completions", {**body, "add_special_tokens": False})
    bare_tokens = bare["choices"][0]["logprobs"]["tokens"]
    assert bare["usage"]["prompt_tokens"] == len(expected)
    assert plain[:2] == [tokenizer.bos_token] * 2 and bare_tokens[0] == tokenizer.bos_token != bare_tokens[1]
