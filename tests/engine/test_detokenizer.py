"""Incremental detokenization: exact deltas with a byte-level BPE tokenizer, stop strings across tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.backend.engine.detokenizer import (
    IncrementalDetokenizer,
    detokenize_incrementally,
    initial_offsets,
)
from pagedserve.testing import EOS_TOKEN, build_tokenizer

TRICKY_TEXT = " Hello  world! 🙂 日本語 and 中文, café ✓\n  indented  "


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], str | None]:
    """Feed tokens one at a time collecting deltas; finish if no stop string matched."""
    deltas, stop = [], None
    for tok in token_ids:
        stop = detok.update([tok])
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    if stop is None:
        detok.finish()
        deltas.append(detok.get_delta())
    return deltas, stop


def test_deltas_rebuild_the_decoded_text_exactly(tokenizer):
    prompt = encode(tokenizer, "The quick")
    output = encode(tokenizer, TRICKY_TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, stop = stream(detok, output)
    assert stop is None
    assert "".join(deltas) == detok.output_text == TRICKY_TEXT
    assert deltas[0] == " "
    # A split character would surface as U+FFFD in some delta.
    assert not any("\ufffd" in d for d in deltas)


def test_multi_byte_character_is_held_until_complete(tokenizer):
    emoji = encode(tokenizer, "🙂")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "hi"))
    for tok in emoji[:-1]:
        detok.update([tok])
        assert detok.get_delta() == ""
    detok.update([emoji[-1]])
    assert detok.get_delta() == "🙂"


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab .,\n日本🙂é✓xyz")), min_size=1, max_size=30))
def test_any_text_streams_back_exactly(tokenizer, text):
    tok = tokenizer
    output = encode(tok, text)
    detok = IncrementalDetokenizer(tok, encode(tok, "Hello"))
    deltas, _ = stream(detok, output)
    assert "".join(deltas) == detok.output_text == tok.decode(output)


def test_stop_string_across_token_boundaries_never_leaks(tokenizer):
    output = encode(tokenizer, "Hello world. STOP here")
    stop_tokens = encode(tokenizer, " STOP")
    assert len(stop_tokens) > 1, "the stop string must span several tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say"), stop=["STOP"])
    deltas, stop = stream(detok, output)
    assert stop == "STOP"
    assert detok.stop_reason == "STOP"
    assert detok.finished
    assert "".join(deltas) == detok.output_text == "Hello world. "


def test_stop_string_kept_when_asked(tokenizer):
    output = encode(tokenizer, "one, two, three, four")
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Count"), stop=["three"],
                                   include_stop_str_in_output=True)
    deltas, stop = stream(detok, output)
    assert stop == "three"
    assert "".join(deltas) == detok.output_text == "one, two, three"


def test_earliest_of_several_stop_strings_wins_within_one_update(tokenizer):
    output = encode(tokenizer, "a + b; return a")
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "def"), stop=["return", ";"])
    assert detok.update(output) == ";"
    assert detok.output_text == "a + b"
    assert detok.update(encode(tokenizer, " more")) is None
    assert detok.get_delta() == "a + b"


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "x"), stop=["\n\n"])
    detok.update(encode(tokenizer, "a\n"))
    assert detok.get_delta() == "a"
    detok.update(encode(tokenizer, "b"))
    assert detok.get_delta() == "\nb"


def test_stop_strings_watched_from_min_tokens_on_never_match_text_already_handed_out(tokenizer):
    # What min_tokens does: no stop strings until the min_tokens-th token, then these.
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "x"))
    handed = []
    for tok in encode(tokenizer, " jumps o"):
        detok.update([tok])
        handed.append(detok.get_delta())
    detok.watch_stop_strings(["jum", "over", "a-much-longer-stop"])
    deltas, stop = stream(detok, encode(tokenizer, "ver the lazy jumper"))
    # Neither the "jum" before nor the "over" across the switch counts; the later "jum" does.
    assert stop == "jum"
    assert "".join(handed + deltas) == detok.output_text == " jumps over the lazy "


def test_stop_string_inside_a_multi_byte_run(tokenizer):
    output = encode(tokenizer, "ok 日本語 done")
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "x"), stop=["本"])
    deltas, stop = stream(detok, output)
    assert stop == "本"
    assert "".join(deltas) == "ok 日"


def test_finish_flushes_an_incomplete_character(tokenizer):
    emoji = encode(tokenizer, "🙂")
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "x"))
    detok.update(encode(tokenizer, "ab"))
    detok.update(emoji[:2])
    assert detok.get_delta() == "ab"
    detok.finish()
    tail = detok.get_delta()
    assert tail.startswith("\ufffd")
    assert "ab" + tail == detok.output_text == tokenizer.decode(encode(tokenizer, "ab") + emoji[:2])


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    output = encode(tokenizer, "Hi") + [eos] + encode(tokenizer, " there")
    skipped = IncrementalDetokenizer(tokenizer, [eos])
    kept = IncrementalDetokenizer(tokenizer, [eos], skip_special_tokens=False)
    assert "".join(stream(skipped, output)[0]) == "Hi there"
    assert "".join(stream(kept, output)[0]) == f"Hi{EOS_TOKEN} there"


def test_stateless_offsets_reproduce_the_text(tokenizer):
    prompt = encode(tokenizer, "Question:")
    output = encode(tokenizer, TRICKY_TEXT)
    ids = list(prompt)
    prefix_offset, read_offset = initial_offsets(len(prompt))
    pieces = []
    for tok in output:
        ids.append(tok)
        text, prefix_offset, read_offset = detokenize_incrementally(tokenizer, ids, prefix_offset, read_offset)
        pieces.append(text)
    assert "".join(pieces) == TRICKY_TEXT
    assert read_offset == len(ids)
