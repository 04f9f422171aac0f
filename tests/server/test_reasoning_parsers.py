"""Reasoning parsers on canned text: the whole split, and the same text streamed cut at every place (a cut
anywhere inside a marker included) giving the same reasoning and answer, with no marker text in a delta."""

from __future__ import annotations

import pytest

from pagedserve.client.openai.reasoning import REASONING_PARSERS, Phase, Split


def _streamed(parser, text: str, cuts: list[int], phase: Phase = Phase.OPEN) -> tuple[Split, list[Split]]:
    stream = parser.stream(phase)
    bounds = [0, *cuts, len(text)]
    pairs = list(zip(bounds[:-1], bounds[1:], strict=True))
    deltas = [stream.feed(text[a:b], final=i == len(pairs) - 1) for i, (a, b) in enumerate(pairs)]
    return Split("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)), deltas


def _texts(parser) -> list[tuple[str, Phase, Split]]:
    s, e = parser.start, parser.end
    cases = [
        (f"{s}\nweigh it\n{e}\n\nThe answer.", Phase.OPEN, Split("\nweigh it\n", "\n\nThe answer.")),
        (f"{s}never closed", Phase.OPEN, Split("never closed", "")),
        (f"{s}{e}", Phase.OPEN, Split("", "")),
        (f"thinking<{e}answer {s} kept", Phase.REASONING, Split("thinking<", f"answer {s} kept")),
        (f"all answer {e}", Phase.ANSWER, Split("", f"all answer {e}")),
    ]
    implicit = Split("plain ", "after") if parser.implicit_start else Split("", f"plain {e}after")
    cases.append((f"plain {e}after", Phase.OPEN, implicit))
    cases.append((s[:-1], Phase.OPEN, Split(s[:-1], "") if parser.implicit_start else Split("", s[:-1])))
    return cases


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_whole_split(name: str) -> None:
    parser = REASONING_PARSERS[name]()
    for text, phase, expected in _texts(parser):
        assert parser.split(text, phase) == expected, text


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_every_single_cut_and_every_character_streams_the_same(name: str) -> None:
    parser = REASONING_PARSERS[name]()
    for text, phase, expected in _texts(parser):
        for cut in range(1, len(text)):
            assert _streamed(parser, text, [cut], phase)[0] == expected, (text, cut)
        total, deltas = _streamed(parser, text, list(range(1, len(text))), phase)
        assert total == expected, text
        for delta in deltas:  # no delta carries a piece of a marker when the whole split has none there
            assert parser.end not in delta.reasoning and parser.start not in delta.reasoning


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_every_pair_of_cuts_inside_the_markers(name: str) -> None:
    parser = REASONING_PARSERS[name]()
    text = f"{parser.start}ab{parser.end}cd"
    expected = parser.split(text)
    for first in range(1, len(text)):
        for second in range(first + 1, len(text)):
            assert _streamed(parser, text, [first, second])[0] == expected, (first, second)


def test_marker_held_until_decided() -> None:
    stream = REASONING_PARSERS["qwen3"]().stream()
    assert stream.feed("<th") == Split()
    assert stream.feed("ink>x</") == Split("x", "")
    assert stream.feed("thin") == Split()
    assert stream.feed("g") == Split("</thing", "")  # not the end marker after all
    assert stream.feed("</think>y") == Split("", "y")
    assert stream.answering and stream.saw_reasoning


def test_prompt_phase() -> None:
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.prompt_phase("<|im_start|>assistant\n<think>\n") is Phase.REASONING
    assert parser.prompt_phase("<|im_start|>assistant\n<think>\n\n</think>\n\n") is Phase.ANSWER
    assert parser.prompt_phase("<|im_start|>assistant\n") is Phase.OPEN


def test_registry_has_vllm_names() -> None:
    assert {"qwen3", "deepseek_r1"} <= set(REASONING_PARSERS)
    assert all(name == cls.name for name, cls in REASONING_PARSERS.items())


@pytest.mark.parametrize("add_arguments", ["launcher", "shim"])
def test_unknown_parser_refused_at_start(add_arguments: str, capsys) -> None:
    import argparse

    from pagedserve.client import launcher
    from pagedserve.client.openai.main import add_arguments as shim_arguments

    parser = argparse.ArgumentParser()
    (launcher.add_arguments if add_arguments == "launcher" else shim_arguments)(parser)
    assert parser.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--reasoning-parser", "bogus"])
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "--reasoning-parser" in error and "deepseek_r1" in error


def test_history_reasoning_reaches_the_template_as_reasoning_content() -> None:
    from pagedserve.client.openai.errors import APIError
    from pagedserve.client.openai.protocol import parse_chat_request

    turn = {"role": "assistant", "content": "yes", "reasoning": "r", "reasoning_content": "r"}
    request = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}, turn,
                                                             {"role": "user", "content": "again"}]})
    assert request.messages[1] == {"role": "assistant", "content": "yes", "reasoning_content": "r"}
    for bad in ({"role": "user", "content": "q", "reasoning": "r"}, {**turn, "reasoning_content": 3}):
        with pytest.raises(APIError) as info:
            parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "q"}, bad]})
        assert info.value.param.startswith("messages[")


def test_serve_hands_the_parser_to_the_shim() -> None:
    import argparse

    from pagedserve.client import launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    flags = launcher._tool_flags(parser.parse_args(["--reasoning-parser", "deepseek_r1"]))
    assert flags[flags.index("--reasoning-parser") + 1] == "deepseek_r1"
    assert "--reasoning-parser" not in launcher._tool_flags(parser.parse_args([]))
