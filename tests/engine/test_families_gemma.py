"""Gemma 2 and Gemma 3 (text) against transformers: tiny random checkpoints saved by transformers' own classes
(norm weights drawn, embeddings tied as Gemma's are) run the staggered parity batch with a sliding window of 8,
shorter than most prompts; each Gemma feature is shown to change the output, so parity checks it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.model import ModelArchConfig, UnsupportedModelError
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine
from tests.support.parity import assert_staggered_batch_matches_transformers, parity_prompts

# Gemma 2's chat template: no system role, user/model turns strictly alternating.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# Gemma 3 4B and larger: a linear factor of 8 on the global layers' rope only.
GEMMA3_SCALED_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}


@pytest.fixture(scope="module")
def tiny_gemma2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2: layer 0 slides over 8 tokens, layer 1 is global; attention capped at 5, final logits at 10."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2", seed=31, random_norms=True,
                           tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3: layers 0 and 2 slide over 8 tokens with rope base 1e4, layers 1 and 3 are global with 1e6."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", seed=32, random_norms=True,
                           tie_word_embeddings=True, num_layers=4)


@pytest.mark.parametrize("model_fixture", ["tiny_gemma2_path", "tiny_gemma3_path"])
def test_staggered_batch_matches_transformers_greedy_per_prompt(model_fixture, request, hf_reference):
    assert_staggered_batch_matches_transformers(request.getfixturevalue(model_fixture), hf_reference)


def _prompt_logprobs(path: Path) -> list[float]:
    engine = cpu_engine(path, block_size=4, num_blocks=32, max_num_batched_tokens=16)
    prompt = parity_prompts(engine.vocab_size)[7]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return [entry[tok] for entry, tok in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]


def test_gemma3_with_linear_rope_on_global_layers_matches_transformers_prompt_logprobs(tmp_path, hf_reference):
    path = make_tiny_model(tmp_path / "gemma3-scaled", "gemma3", seed=33, random_norms=True,
                           config_extras={"rope_parameters": GEMMA3_SCALED_ROPE})
    assert ModelArchConfig.from_pretrained(path).rope_scaling == {"rope_type": "linear", "factor": 8.0}
    prompt = parity_prompts(384)[7]
    assert _prompt_logprobs(path) == pytest.approx(hf_reference.prompt_logprobs(path, prompt), abs=1e-4)


@pytest.mark.parametrize(("model_fixture", "change"), [
    ("tiny_gemma2_path", {"attn_logit_softcapping": None}),
    ("tiny_gemma2_path", {"final_logit_softcapping": None}),
    ("tiny_gemma2_path", {"sliding_window": 4096}),
    ("tiny_gemma2_path", {"query_pre_attn_scalar": 16}),
    ("tiny_gemma3_path", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}),
    ("tiny_gemma3_path", {"layer_types": ["full_attention"] * 4}),
], ids=["attention-cap", "final-cap", "window", "attention-scale", "local-rope-base", "layer-types"])
def test_each_gemma_feature_changes_the_output(model_fixture, change, request, tmp_path):
    path = request.getfixturevalue(model_fixture)
    changed = _copy_with_config(path, tmp_path / "changed", **change)
    assert _prompt_logprobs(changed) != pytest.approx(_prompt_logprobs(path), abs=1e-3)


def test_configs_without_layer_types_take_transformers_patterns(tiny_gemma2_path, tiny_gemma3_path):
    gemma2 = json.loads((tiny_gemma2_path / "config.json").read_text())
    del gemma2["layer_types"]
    gemma2.update(num_hidden_layers=4)
    cfg = ModelArchConfig.from_dict(gemma2)
    assert [cfg.window_of(i) for i in range(4)] == [8, None, 8, None]
    # A Gemma 3 config as transformers 4 wrote it: top-level rope keys, a pattern of 6, no layer_types.
    gemma3 = json.loads((tiny_gemma3_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "sliding_window_pattern", "_sliding_window_pattern"):
        gemma3.pop(key, None)
    gemma3.update(num_hidden_layers=7, rope_theta=500_000.0, rope_local_base_freq=20_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = ModelArchConfig.from_dict(gemma3)
    assert [cfg.window_of(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (500_000.0, 20_000.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_activation": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope type 'yarn' for the sliding layers is not supported"),
])
def test_unsupported_gemma_configs_are_named(tiny_gemma3_path, change, message):
    config = json.loads((tiny_gemma3_path / "config.json").read_text())
    config.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelArchConfig.from_dict(config)


def test_gemma_chat_template_renders_through_the_openai_shim_like_transformers(tiny_gemma2_path, tmp_path):
    from transformers import AutoTokenizer

    from pagedserve.client.openai.chat_template import ChatTemplate
    from pagedserve.client.openai.errors import APIError

    folder = tmp_path / "gemma-chat"
    shutil.copytree(tiny_gemma2_path, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(folder)
    messages = [{"role": "user", "content": "Hi there "}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Café? 🙂"}]
    template = ChatTemplate.from_model_dir(folder)
    rendered = template.render(messages)
    assert rendered == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<start_of_turn>user\nCafé? 🙂<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(APIError, match="System role not supported") as info:
        template.render([{"role": "system", "content": "Be brief."}, *messages])
    assert info.value.status == 400 and info.value.param == "messages"


def _copy_with_config(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target
