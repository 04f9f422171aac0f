"""LLMEngine behaviour a user sees: validation, stop conditions, streaming, abort, n>1, errors, stats."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.backend.model import UnsupportedModelError
from pagedserve.testing import copy_with_bos_tokenizer
from tests.support.engines import cpu_engine, greedy, run_to_end

PROMPT = "The quick brown fox"


@pytest.fixture
def engine(tiny_llama_path) -> LLMEngine:
    return cpu_engine(tiny_llama_path, block_size=4, num_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": None, "prompt_token_ids": [1, 10_000]}, "prompt_token_ids"),
        ({"prompt": None, "prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt": None, "prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt": None, "prompt_token_ids": [5] * 200}, "prompt_token_ids"),
        ({"prompt": "hi", "params": SamplingParams(max_tokens=500)}, "max_tokens"),
        ({"prompt": "hi", "params": {"temperature": 0}}, "sampling_parameters"),
        ({"request_id": "", "prompt": "hi"}, "request_id"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(engine, kwargs, field):
    kwargs = {"request_id": "bad", **kwargs}
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(**kwargs)
    assert info.value.field == field
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("same", PROMPT, greedy())
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("same", PROMPT, greedy())
    assert info.value.field == "request_id"


def test_unknown_engine_option_is_refused(tiny_llama_path):
    with pytest.raises(InvalidRequestError) as info:
        LLMEngine.from_pretrained(str(tiny_llama_path), num_block=3)
    assert info.value.field == "num_block"


def test_unsupported_architecture_names_it_and_the_supported_list(tiny_llama_path, tmp_path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLMEngine.from_pretrained(str(folder))


def test_max_tokens_ends_with_length(engine):
    out = engine.generate(PROMPT, greedy(max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.finished and out.error is None


def test_stop_token_id_ends_with_stop_and_names_the_token(engine):
    tokens = engine.generate(PROMPT, greedy())[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = engine.generate(PROMPT, greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_stop_token_text_is_left_out_unless_include_stop_str_in_output(engine):
    tokens = engine.generate(PROMPT, greedy())[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    decode = engine.tokenizer.decode
    out = engine.generate(PROMPT, greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    kept = engine.generate(PROMPT, greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True))[0].outputs[0]
    assert out.token_ids == kept.token_ids == tokens[: first + 1]
    assert out.text == decode(tokens[:first], skip_special_tokens=True)
    assert kept.text == decode(tokens[: first + 1], skip_special_tokens=True) != out.text


def test_eos_stops_unless_ignored_and_min_tokens_suppresses_it(engine):
    tokens = engine.generate(PROMPT, greedy())[0].outputs[0].token_ids
    # Random weights rarely pick a real eos; make the first greedy token an eos for this engine.
    engine.eos_token_ids.add(tokens[0])
    engine.sampler.eos_token_ids.add(tokens[0])
    stopped = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == ([tokens[0]], "stop", None)
    ignored = engine.generate(PROMPT, greedy())[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"
    delayed = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, min_tokens=3))[0].outputs[
        0
    ]
    assert len(delayed.token_ids) >= 3
    assert tokens[0] not in delayed.token_ids[:3]


def test_stop_string_across_token_boundary_cuts_the_text(engine):
    full = engine.generate(PROMPT, greedy(max_tokens=24))[0].outputs[0]
    stop, cut = _straddling_stop_string(engine.tokenizer, full.token_ids, full.text)
    out = engine.generate(PROMPT, greedy(max_tokens=24, stop=[stop]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full.text[:cut]
    included = engine.generate(PROMPT, greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))
    assert included[0].outputs[0].text == full.text[: cut + len(stop)]


def _straddling_stop_string(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """Two characters, the last of one token's text and the first of the next's, first seen there."""
    for i in range(1, len(token_ids) - 1):
        before, after = tokenizer.decode(token_ids[:i]), tokenizer.decode(token_ids[: i + 1])
        if not before or "\ufffd" in after or not after.startswith(before) or len(after) == len(before):
            continue
        stop = before[-1] + after[len(before)]
        if text.index(stop) == len(before) - 1:
            return stop, len(before) - 1
    raise AssertionError("no token boundary with clean text on both sides")


def test_streamed_deltas_concatenate_to_the_final_text(engine):
    deltas, token_deltas = [], []
    outputs = list(engine.stream("Café 🙂 naïve", greedy(max_tokens=24)))
    for out in outputs:
        deltas.append(out.outputs[0].text_delta)
        token_deltas += out.outputs[0].token_ids_delta
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert "".join(deltas) == final.text
    assert token_deltas == final.token_ids
    assert final.text == engine.tokenizer.decode(final.token_ids)


def test_stream_with_stop_string_never_shows_it(engine):
    full = engine.generate(PROMPT, greedy(max_tokens=24))[0].outputs[0]
    stop, cut = _straddling_stop_string(engine.tokenizer, full.token_ids, full.text)
    outputs = list(engine.stream(PROMPT, greedy(max_tokens=24, stop=[stop])))
    streamed = "".join(o.outputs[0].text_delta for o in outputs)
    assert streamed == full.text[:cut]
    assert all(stop not in o.outputs[0].text for o in outputs)


def test_abort_ends_one_request_and_frees_its_blocks(engine):
    engine.add_request("keep", PROMPT, greedy(max_tokens=8))
    engine.add_request("drop", PROMPT + " jumps", greedy(max_tokens=8))
    engine.step()
    engine.step()
    engine.abort_request("drop")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["drop"].finished and outs["drop"].outputs[0].finish_reason == "abort"
    final = run_to_end(engine)
    assert final["keep"].outputs[0].finish_reason == "length"
    assert len(final["keep"].outputs[0].token_ids) == 8
    assert engine.get_stats().kv_cache_usage == 0.0


def test_failing_step_errors_its_requests_and_the_engine_serves_on(engine):
    expected = engine.generate(PROMPT, greedy(max_tokens=6))[0].outputs[0].token_ids
    calls = []
    execute = engine.runner.execute

    def fail_second_step(sched):
        calls.append(len(sched.scheduled))
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return execute(sched)

    engine.runner.execute = fail_second_step
    engine.add_request("doomed", PROMPT, greedy(max_tokens=6))
    engine.step()
    outs = engine.step()
    assert [o.request_id for o in outs] == ["doomed"]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert "injected fault" in outs[0].error
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    after = engine.generate(PROMPT, greedy(max_tokens=6))[0].outputs[0].token_ids
    assert after == expected


def test_n4_shares_the_prompt_blocks_and_greedy_copies_agree(engine):
    prompt_ids = list(range(10, 30))  # 20 tokens: 5 full blocks of 4
    engine.add_request("n4", None, greedy(max_tokens=6, n=4), prompt_token_ids=prompt_ids)
    engine.step()  # prefill, then fork
    bm = engine.scheduler.block_manager
    tables = [bm.get_block_table(rid) for rid in ["n4", "n4#1", "n4#2", "n4#3"]]
    assert all(t[:5] == tables[0][:5] for t in tables)
    assert bm.num_blocks - bm.num_free_blocks < 4 * 6  # far fewer than 4 separate copies
    out = run_to_end(engine)["n4"]
    alone = engine.generate([prompt_ids], greedy(max_tokens=6))[0].outputs[0].token_ids
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == alone for c in out.outputs)


def test_n_greater_than_1_counts_every_sequence_against_max_num_seqs(tiny_llama_path):
    engine = cpu_engine(tiny_llama_path, block_size=4, num_blocks=128, max_model_len=128, max_num_seqs=4)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT, greedy(max_tokens=5, n=3))
    most = 0
    final = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        most = max(most, engine.get_stats().num_running)
        final.update({o.request_id: o for o in outputs if o.finished})
    # Each request forks into 3 sequences at its first token: two requests at once would make 6.
    assert most == 3
    assert sorted(final) == ["r0", "r1", "r2"] and all(len(o.outputs) == 3 for o in final.values())
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("wide", PROMPT, greedy(n=5))
    assert info.value.field == "n" and "max_num_seqs (4)" in str(info.value)


def test_a_prompt_rendered_from_a_chat_template_gets_no_second_bos(tiny_llama_path, tmp_path):
    # A tokenizer that adds a BOS of its own, as Llama's do; its chat template starts with the BOS too.
    folder = copy_with_bos_tokenizer(tiny_llama_path, tmp_path / "bos")
    engine = cpu_engine(folder, max_model_len=128)
    rendered = "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    engine.add_request("plain", rendered, greedy(max_tokens=1, prompt_logprobs=0))
    engine.add_request("chat", rendered, greedy(max_tokens=1, prompt_logprobs=0), add_special_tokens=False)
    ids = {rid: out.prompt_token_ids for rid, out in run_to_end(engine).items()}
    assert ids["chat"][0] == 0 and ids["chat"][1] != 0  # one BOS: the template's
    assert ids["plain"] == [0, *ids["chat"]]  # the tokenizer's own BOS on top


def test_seeded_sampling_is_the_same_alone_or_in_a_batch(engine):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = engine.generate(PROMPT, seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    batch = engine.generate(["Hello", PROMPT, "one two three"], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone


def test_n4_with_seed_gives_distinct_reproducible_samples(engine):
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in engine.generate(PROMPT, params)[0].outputs]
    second = [c.token_ids for c in engine.generate(PROMPT, params)[0].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) > 1


def test_stats_count_tokens_and_prefix_hits(engine):
    prompt_ids = list(range(10, 30))
    engine.generate([prompt_ids, prompt_ids], greedy(max_tokens=3))
    engine.generate([prompt_ids], greedy(max_tokens=3))
    stats = engine.get_stats()
    assert stats.prompt_tokens == 60
    assert stats.generation_tokens == 9
    assert stats.prefix_cache_hits >= 16
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_unsupported_rope_scaling_is_refused_at_load(tiny_llama_path, tmp_path):
    folder = tmp_path / "yarn"
    shutil.copytree(tiny_llama_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="yarn.*llama3"):
        LLMEngine.from_pretrained(str(folder))


def test_missing_model_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLMEngine.from_pretrained(str(tmp_path / "nowhere"))


def test_closing_a_stream_early_aborts_its_request(engine):
    stream = engine.stream(PROMPT, greedy(max_tokens=20))
    next(stream)
    stream.close()
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("stream-0", "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0


def test_stop_strings_count_only_from_min_tokens_on(engine):
    full = engine.generate(PROMPT, greedy(max_tokens=24))[0].outputs[0]
    stop, cut = _straddling_stop_string(engine.tokenizer, full.token_ids, full.text)
    early = engine.generate(PROMPT, greedy(max_tokens=24, stop=[stop]))[0].outputs[0]
    delayed = engine.generate(PROMPT, greedy(max_tokens=24, stop=[stop], min_tokens=10))[0].outputs[0]
    assert len(early.token_ids) < 10
    assert len(delayed.token_ids) >= 10
    assert delayed.text.startswith(full.text[: cut + len(stop)])


def test_kv_cache_is_sized_from_the_memory_budget_and_logged(tiny_llama_path, caplog):
    # tiny llama: 2 layers, 2 KV heads of 16 dims; fp32 K and V: 2 * 2 * 16 * 2 * 16 * 4 = 8 KiB per block.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    with caplog.at_level("INFO", logger="pagedserve.backend.worker.model_runner"):
        engine = cpu_engine(tiny_llama_path, kv_cache_memory_bytes=37 * block_bytes + 5)
    assert engine.runner.num_blocks == 37
    assert engine.runner.key_caches[0].shape == (37, 16, 2, 16)
    assert "37 blocks" in caplog.text
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        cpu_engine(tiny_llama_path, kv_cache_memory_bytes=100)


def test_generate_with_one_bad_prompt_queues_none(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate([PROMPT, ""], greedy())
    assert info.value.field == "prompt"
    assert not engine.has_unfinished_requests()
    assert engine.generate(PROMPT, greedy(max_tokens=3))[0].outputs[0].finish_reason == "length"


def test_user_ids_that_look_like_sequence_ids_do_not_collide(engine):
    engine.add_request("x#1", PROMPT, greedy(max_tokens=4))
    engine.add_request("x", PROMPT, greedy(max_tokens=4, n=2))
    final = run_to_end(engine)
    assert final["x#1"].outputs[0].finish_reason == "length"
    assert [len(c.token_ids) for c in final["x"].outputs] == [4, 4]


def test_logprobs_hold_the_top_n_plus_the_chosen_token_and_sum_to_the_cumulative(engine):
    out = engine.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=3))[
        0
    ].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for entry, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert tok in entry and 3 <= len(entry) <= 4
        assert all(lp <= 0.0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(out.logprobs, out.token_ids, strict=True))
    )
    assert engine.generate(PROMPT, greedy(max_tokens=2))[0].outputs[0].logprobs is None
