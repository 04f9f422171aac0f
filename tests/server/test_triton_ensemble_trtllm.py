"""The ensemble answers what TensorRT-LLM's clients send, unchanged: every input with its batch dimension
([1, 1] scalars, [1, N] stop/bad word lists, as its end_to_end_grpc_client.py and genai-perf build them),
batches of several rows in one call (each row answered, tagged with its batch_index), and the HTTP
generate / generate_stream JSON of its docs."""

from __future__ import annotations

import json
import queue
import re

import jsonschema
import numpy as np
import pytest

pytestmark = pytest.mark.slow

RESPONSE_TIMEOUT_SECONDS = 120

# The dtypes of TensorRT-LLM's ensemble config.pbtxt.
DTYPES = {
    "text_input": np.object_, "stop_words": np.object_, "bad_words": np.object_,
    "max_tokens": np.int32, "min_tokens": np.int32, "min_length": np.int32, "beam_width": np.int32,
    "num_return_sequences": np.int32, "top_k": np.int32, "end_id": np.int32, "pad_id": np.int32,
    "temperature": np.float32, "top_p": np.float32, "seed": np.uint64, "random_seed": np.uint64,
    "stream": np.bool_, "exclude_input_in_output": np.bool_, "return_log_probs": np.bool_,
    "return_context_logits": np.bool_,
    "guided_decoding_guide_type": np.object_, "guided_decoding_guide": np.object_,
}


def trtllm_batch(rows: list[dict]) -> dict[str, np.ndarray]:
    """The tensors end_to_end_grpc_client.py sends: each row's values as [1, 1] arrays (word lists [1, N]),
    concatenated along the batch dimension, word lists padded with empty strings to one width."""
    tensors = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if DTYPES[name] is np.object_:
            lists = [[v] if isinstance(v, str) else v for v in values]
            width = max(len(words) for words in lists)
            array = np.array([[w.encode() for w in words] + [b""] * (width - len(words)) for words in lists],
                             dtype=np.object_)
        else:
            array = np.array([[v] for v in values], dtype=DTYPES[name])
        tensors[name] = array
    return tensors


def stream_all(server, values: dict[str, np.ndarray], errors_to_end: int | None = None) -> tuple[list, list[str]]:
    """Every response of one ensemble request until the final flag: (results, error messages), errors of
    single rows included (the stream goes on after them). A streamed error does not show its final flag, so
    the collection also ends at `errors_to_end` errors (default: one per row)."""
    results, errors = [], []
    with server.open_stream("ensemble", values) as stream:
        try:
            while True:
                answer = stream.next(RESPONSE_TIMEOUT_SECONDS)
                if answer.error is not None:
                    errors.append(str(answer.error))
                    if len(errors) == (errors_to_end or len(values["text_input"])):
                        return results, errors
                    continue
                if answer.result.get_response().outputs:
                    results.append(answer.result)
                if answer.final:
                    return results, errors
        except queue.Empty:
            pytest.fail(f"no final response within {RESPONSE_TIMEOUT_SECONDS} s: {len(results)} responses, {errors}")


def finals(results: list) -> list[bool]:
    """The triton_final_response flag of every result."""
    return [r.get_response().parameters["triton_final_response"].bool_param for r in results]


def by_row(results: list) -> dict[int, list[str]]:
    """The texts of each batch row, in order, read as the end-to-end client reads them (output[0], [0][0])."""
    texts: dict[int, list[str]] = {}
    for result in results:
        row = int(result.as_numpy("batch_index")[0][0])
        texts.setdefault(row, []).append(result.as_numpy("text_output")[0].decode("utf-8"))
    return texts


def greedy_row(prompt: str, max_tokens: int, **extra) -> dict:
    """One row as end_to_end_grpc_client.py fills it (beam_width 1, one sequence), greedy, without the prompt
    in the output, and min_length = max_tokens so the tiny model's eos cannot end it early."""
    return {"text_input": prompt, "max_tokens": max_tokens, "min_length": max_tokens, "beam_width": 1,
            "num_return_sequences": 1, "temperature": 0.0, "exclude_input_in_output": True, **extra}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_batch_of_three_rows_in_one_call_is_answered_row_by_row(triton_server, stream):
    rows = [greedy_row("The capital of France is", 6), greedy_row("Café, naïve, 日本語", 9),
            greedy_row("  two leading spaces", 12)]
    results, errors = stream_all(triton_server, trtllm_batch([{**row, "stream": stream} for row in rows]))
    assert errors == []
    texts = by_row(results)
    assert sorted(texts) == [0, 1, 2]
    if stream:
        assert [len(texts[i]) for i in range(3)] == [6, 9, 12]  # one response per token
    else:
        assert [len(texts[i]) for i in range(3)] == [1, 1, 1]
    assert finals(results) == [False] * (len(results) - 1) + [True]
    for index, row in enumerate(rows):
        alone, alone_errors = stream_all(triton_server, trtllm_batch([row]))
        assert alone_errors == [] and len(alone) == 1
        assert "".join(texts[index]) == alone[0].as_numpy("text_output")[0].decode("utf-8")


def test_a_batch_of_one_streams_the_text_the_llm_model_generates(triton_server):
    prompt = "Paged attention stores keys"
    row = greedy_row(prompt, 16)
    streamed, errors = stream_all(triton_server, trtllm_batch([{**row, "stream": True}]))
    whole, whole_errors = stream_all(triton_server, trtllm_batch([row]))
    assert errors == whole_errors == []
    assert [r.as_numpy("text_output").shape for r in streamed] == [(1,)] * 16
    assert {r.as_numpy("batch_index").shape for r in streamed} == {(1, 1)}
    llm = triton_server.generate("llm", {"text_input": prompt, "max_tokens": 16, "min_tokens": 16,
                                         "temperature": 0.0, "exclude_input_in_output": True})
    assert "".join(by_row(streamed)[0]) == by_row(whole)[0][0] == llm["text_output"]


def test_stop_words_of_a_row_end_its_text_at_the_first_stop_word(triton_server):
    # min_length 0: stop words are only watched from min_length on.
    row = greedy_row("Paged attention stores keys", 24, min_length=0, bad_words=[""])
    full, _ = stream_all(triton_server, trtllm_batch([row]))
    text = by_row(full)[0][0]
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    for stream in (False, True):
        cut, errors = stream_all(triton_server,
                                 trtllm_batch([{**row, "stop_words": [stop, "@@never@@"], "stream": stream}]))
        assert errors == []
        stopped = "".join(by_row(cut)[0])
        # The ensemble decodes whole tokens: its text keeps the stop word (and the rest of its last token).
        assert text.startswith(stopped) and text.index(stop) + len(stop) <= len(stopped) < len(text)


def test_a_bad_row_refuses_the_whole_batch_naming_the_field_and_the_row(triton_server):
    rows = [greedy_row("Hello", 4, top_p=0.5), greedy_row("Bye", 4, top_p=1.5)]
    results, errors = stream_all(triton_server, trtllm_batch(rows), errors_to_end=1)
    assert results == []
    assert len(errors) == 1 and errors[0].startswith("top_p") and "(batch_index 1)" in errors[0]


def test_a_row_the_llm_refuses_gets_its_error_and_the_other_rows_finish(triton_server):
    rows = [greedy_row("Hello", 8), greedy_row("word " * 300, 8)]  # the second is over max_model_len (256)
    results, errors = stream_all(triton_server, trtllm_batch([{**row, "stream": True} for row in rows]))
    assert len(errors) == 1 and "max_model_len" in errors[0] and "(batch_index 1)" in errors[0]
    assert sorted(by_row(results)) == [0] and len(by_row(results)[0]) == 8
    assert finals(results)[-1]


def test_older_trtllm_names_random_seed_and_min_length_mean_seed_and_min_tokens(triton_server):
    sampled = {"text_input": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "stream": True}
    new, _ = stream_all(triton_server, trtllm_batch([{**sampled, "seed": 7, "min_tokens": 10}]))
    old, _ = stream_all(triton_server, trtllm_batch([{**sampled, "random_seed": 7, "min_length": 10}]))
    assert len(new) == len(old) == 10
    assert by_row(new) == by_row(old)
    both, errors = stream_all(triton_server, trtllm_batch([{**sampled, "seed": 7, "random_seed": 7}]))
    assert both == [] and errors[0].startswith("random_seed")


def test_http_generate_and_generate_stream_take_the_json_of_trtllm_docs(triton_server):
    body = {"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "", "stop_words": ""}
    status, _ = triton_server.post("/v2/models/ensemble/generate", body)
    assert status == 200
    events = triton_server.generate_stream("ensemble", {**body, "stream": True})
    assert events and all(e["batch_index"] == 0 for e in events)
    greedy = {**body, "temperature": 0.0, "min_tokens": 20}
    whole = triton_server.generate("ensemble", greedy)
    streamed = triton_server.generate_stream("ensemble", {**greedy, "stream": True})
    assert len(streamed) == 20
    # generate echoes the prompt (exclude_input_in_output defaults to false); streamed deltas never repeat it.
    assert whole["text_output"] == body["text_input"] + "".join(e["text_output"] for e in streamed)
    assert whole["batch_index"] == 0 and whole["sequence_index"] == 0


def test_trtllm_inputs_pagedserve_cannot_honour_are_refused_by_name(triton_server):
    row = greedy_row("Hello", 2)
    _, errors = stream_all(triton_server, trtllm_batch([{**row, "return_context_logits": True}]))
    assert errors and errors[0].startswith("return_context_logits")
    results, errors = stream_all(triton_server, trtllm_batch([{**row, "return_context_logits": False}]))
    assert errors == [] and len(results) == 1
    status, text = triton_server.post("/v2/models/ensemble/generate",
                                      {"text_input": "Hello", "max_tokens": 2, "lora_task_id": 3})
    assert status == 400 and "lora_task_id" in text


def test_tensors_without_the_batch_dimension_are_refused_naming_the_input(triton_server):
    _, errors = stream_all(triton_server, {"text_input": np.array([b"Hello"], dtype=np.object_)})
    assert errors and "unexpected shape for input 'text_input'" in errors[0]


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9999}},
                 "required": ["answer"], "additionalProperties": False}
DIGITS_REGEX = "[0-9]{4}"
PAREN_GRAMMAR = 'root ::= "(" [0-9] [0-9]? [0-9]? ")"'
# TensorRT-LLM's guide type -> (its guide, the llm's structured_outputs for it).
GUIDES = {
    "json": ("", {"json_object": True}),
    "json_schema": (json.dumps(ANSWER_SCHEMA), {"json": ANSWER_SCHEMA}),
    "regex": (DIGITS_REGEX, {"regex": DIGITS_REGEX}),
    "ebnf_grammar": (PAREN_GRAMMAR, {"grammar": PAREN_GRAMMAR}),
}


def assert_follows_guide(guide_type: str, text: str) -> None:
    """`text` is what the guide allows, whole: JSON, the schema's JSON, the regex's or grammar's string."""
    if guide_type == "json":
        json.loads(text)
    elif guide_type == "json_schema":
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    elif guide_type == "regex":
        assert re.fullmatch(DIGITS_REGEX, text), text
    else:
        assert re.fullmatch(r"\([0-9]{1,3}\)", text), text


# A prompt on which the tiny model's greedy any-JSON ends within max_tokens (its grammar is unbounded).
GUIDED_PROMPT = "Reply in JSON:"


def guided_row(guide_type: str, max_tokens: int = 48, **extra) -> dict:
    """A greedy row with the guide of GUIDES[guide_type]; min_length 0 so the grammar's end ends it."""
    return greedy_row(GUIDED_PROMPT, max_tokens, min_length=0, guided_decoding_guide_type=guide_type,
                      guided_decoding_guide=GUIDES[guide_type][0], **extra)


@pytest.mark.parametrize("guide_type", list(GUIDES))
def test_each_guide_type_constrains_the_row_as_the_llm_constrains_its_spec(triton_server, guide_type):
    results, errors = stream_all(triton_server, trtllm_batch([guided_row(guide_type)]))
    assert errors == []
    (text,) = by_row(results)[0]
    assert_follows_guide(guide_type, text)
    llm = triton_server.generate("llm", {
        "text_input": GUIDED_PROMPT, "exclude_input_in_output": True, "return_finish_reason": True,
        "sampling_parameters": {"temperature": 0.0, "max_tokens": 48, "structured_outputs": GUIDES[guide_type][1]}})
    assert llm["finish_reason"] == "stop" and text == llm["text_output"]


def test_a_batch_guides_each_row_by_its_own_guide_and_leaves_an_unguided_row_alone(triton_server):
    unguided = greedy_row("Paged attention stores keys", 8, guided_decoding_guide_type="", guided_decoding_guide="")
    rows = [guided_row(guide_type, stream=True) for guide_type in GUIDES] + [{**unguided, "stream": True}]
    results, errors = stream_all(triton_server, trtllm_batch(rows))
    assert errors == []
    texts = {row: "".join(parts) for row, parts in by_row(results).items()}
    assert sorted(texts) == list(range(len(rows)))
    for index, guide_type in enumerate(GUIDES):
        assert_follows_guide(guide_type, texts[index])
    alone, _ = stream_all(triton_server, trtllm_batch([{key: unguided[key] for key in unguided
                                                         if not key.startswith("guided")}]))
    assert texts[len(GUIDES)] == by_row(alone)[0][0]
    assert finals(results)[-1]


@pytest.mark.parametrize(("guide_type", "guide", "field", "words"), [
    ("xml", "<a/>", "guided_decoding_guide_type", "must be one of json, json_schema, regex, ebnf_grammar"),
    ("regex", "", "guided_decoding_guide", "must not be empty with guided_decoding_guide_type regex"),
    ("ebnf_grammar", "", "guided_decoding_guide", "must not be empty"),
    ("json_schema", "{not json", "guided_decoding_guide", "is not valid JSON"),
    ("json_schema", "[1, 2]", "guided_decoding_guide", "must be a JSON Schema object"),
    ("", "[0-9]+", "guided_decoding_guide_type", "must be given with guided_decoding_guide"),
], ids=["unknown-type", "regex-without-guide", "grammar-without-guide", "schema-not-json", "schema-not-object",
        "guide-without-type"])
def test_a_bad_guide_refuses_the_batch_naming_the_input_and_the_row(triton_server, guide_type, guide, field, words):
    bad = greedy_row("Hi", 4, guided_decoding_guide_type=guide_type, guided_decoding_guide=guide)
    _, errors = stream_all(triton_server, trtllm_batch([bad]))
    assert len(errors) == 1 and errors[0].startswith(field) and words in errors[0]
    assert f"field={field}]" in errors[0]
    fine = greedy_row("Hi", 4, guided_decoding_guide_type="regex", guided_decoding_guide="[a-c]+")
    results, errors = stream_all(triton_server, trtllm_batch([fine, bad]), errors_to_end=1)
    assert results == [] and len(errors) == 1
    assert errors[0].startswith(field) and "(batch_index 1)" in errors[0]


def test_a_guide_the_engine_cannot_compile_fails_its_row_naming_the_guide(triton_server):
    rows = [guided_row("regex", stream=True),
            greedy_row("Hi", 4, min_length=0, guided_decoding_guide_type="regex", guided_decoding_guide="[a-",
                       stream=True)]
    results, errors = stream_all(triton_server, trtllm_batch(rows))
    assert len(errors) == 1 and errors[0].startswith("guided_decoding_guide: structured_outputs.regex cannot be")
    assert "(batch_index 1)" in errors[0] and errors[0].endswith("field=guided_decoding_guide]")
    assert sorted(by_row(results)) == [0]
    assert_follows_guide("regex", "".join(by_row(results)[0]))


def test_http_generate_takes_the_guided_decoding_json_of_trtllm_docs(triton_server):
    body = {"text_input": GUIDED_PROMPT, "max_tokens": 48, "bad_words": "", "stop_words": "",
            "guided_decoding_guide_type": "json", "exclude_input_in_output": True, "temperature": 0.0}
    json.loads(triton_server.generate("ensemble", body)["text_output"])
    schema = {**body, "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(ANSWER_SCHEMA)}
    events = triton_server.generate_stream("ensemble", {**schema, "stream": True})
    jsonschema.validate(json.loads("".join(e["text_output"] for e in events)), ANSWER_SCHEMA)
    status, text = triton_server.post("/v2/models/ensemble/generate", {**body, "guided_decoding_guide_type": "yaml"})
    assert status == 400 and "guided_decoding_guide_type" in text


def test_bad_words_of_a_row_are_banned_as_the_llm_bans_them_and_other_rows_are_untouched(triton_server):
    prompt = "Paged attention stores keys"
    llm_greedy = {"text_input": prompt, "max_tokens": 16, "min_tokens": 16, "temperature": 0.0,
                  "exclude_input_in_output": True}
    entries = json.loads(triton_server.generate("llm", {**llm_greedy, "return_logprobs": True, "logprobs": 0})["logprobs"])
    # A word the model wrote as one token: banning it must change the text.
    word = next(e["token"].strip() for e in entries if e["token"].strip().isalpha())
    rows = [greedy_row(prompt, 16, bad_words=[word, ""]), greedy_row(prompt, 16, bad_words=["", ""])]
    results, errors = stream_all(triton_server, trtllm_batch(rows))
    assert errors == []
    texts = {row: parts[0] for row, parts in by_row(results).items()}
    plain = triton_server.generate("llm", llm_greedy)["text_output"]
    banned = triton_server.generate("llm", {**llm_greedy, "sampling_parameters": {"bad_words": [word]}})
    assert texts[1] == plain and texts[0] == banned["text_output"] != plain
    _, errors = stream_all(triton_server, trtllm_batch([greedy_row(prompt, 4, bad_words=[" "])]))
    assert len(errors) == 1 and errors[0].startswith("bad_words")
