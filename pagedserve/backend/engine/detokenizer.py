"""Incremental detokenization with stop strings: deltas never split a character or leak a stop string."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

# Decoding starts this many prompt tokens back so the first output token gets its leading space
# (SentencePiece-style decoders drop it on a lone token) and merges with a split character.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What the engine uses of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


def detokenize_incrementally(
    tokenizer: Tokenizer,
    all_token_ids: Sequence[int],
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool = True,
) -> tuple[str, int, int]:
    """Text added by the tokens after `read_offset`, given only the ids and two offsets (no state).

    Returns (new_text, new_prefix_offset, new_read_offset). While the tail decodes to an incomplete
    UTF-8 sequence it returns "" and the old offsets, so a later call emits the whole character.
    Start a sequence with `initial_offsets(num_prompt_tokens)`.
    """
    prefix_text = tokenizer.decode(all_token_ids[prefix_offset:read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(all_token_ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
        return "", prefix_offset, read_offset
    return full_text[len(prefix_text):], read_offset, len(all_token_ids)


def initial_offsets(num_prompt_tokens: int) -> tuple[int, int]:
    """(prefix_offset, read_offset) before the first output token of a prompt this long."""
    return max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens


def _flush(tokenizer: Tokenizer, all_token_ids: Sequence[int], prefix_offset: int, read_offset: int,
           skip_special_tokens: bool) -> str:
    """Whatever the undecoded tail holds, incomplete characters included (as U+FFFD)."""
    prefix_text = tokenizer.decode(all_token_ids[prefix_offset:read_offset],
                                   skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(all_token_ids[prefix_offset:], skip_special_tokens=skip_special_tokens)
    return full_text[len(prefix_text):]


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive, and watches for stop strings.

    `update()` appends tokens and reports a matched stop string; `get_delta()` hands out the text that
    is safe to show; `finish()` releases everything held back once the request ends for another reason.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prefix_offset, self.read_offset = initial_offsets(len(self.token_ids))
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._num_emitted = 0
        self._search_floor = 0  # no stop string may start before this offset of output_text

    def watch_stop_strings(self, stop: Iterable[str]) -> None:
        """Start watching for `stop` (min_tokens reached): only text from here on is searched, so the text
        already handed out can never be cut."""
        self.stop = [s for s in stop if s]
        self._search_floor = len(self.output_text)

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Add output tokens; return the stop string that matched (text cut at it), else None.

        After a stop string matched, further tokens are ignored.
        """
        if self.finished:
            return None
        self.token_ids.extend(new_token_ids)
        new_text, self.prefix_offset, self.read_offset = detokenize_incrementally(
            self.tokenizer, self.token_ids, self.prefix_offset, self.read_offset, self.skip_special_tokens
        )
        if not new_text:
            return None
        searched_from = max(len(self.output_text) - self._longest_stop() + 1, self._search_floor)
        self.output_text += new_text
        return self._check_stop(searched_from)

    def finish(self) -> None:
        """The request ended (eos, length, abort): make all remaining text, split characters too, final."""
        if self.finished:
            return
        self.output_text += _flush(self.tokenizer, self.token_ids, self.prefix_offset, self.read_offset,
                                   self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.finished = True

    def get_delta(self) -> str:
        """Text not handed out before that cannot still turn into part of a stop string."""
        end = len(self.output_text) if self.finished else len(self.output_text) - self._held_back()
        if end <= self._num_emitted:
            return ""
        delta = self.output_text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def _longest_stop(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _check_stop(self, searched_from: int) -> str | None:
        """Cut output_text at the earliest stop string starting at or after `searched_from`."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, searched_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        cut = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:cut]
        self.stop_reason = stop
        self.finished = True
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of output_text that is a proper prefix of some stop string."""
        text = self.output_text
        held = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:length]):
                    held = length
                    break
        return held
