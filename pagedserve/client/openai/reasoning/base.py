"""What every reasoning parser shares: the two markers around a model's thinking, where the prompt leaves
the model (inside its thinking, after it, or free to start it), and one streaming split that the whole
answer is also made from, so streamed deltas add up to the non-streamed fields byte for byte.

The split reads the llm model's text deltas: a marker cut anywhere between two deltas is held until it is
complete (or proven not to be one), so no delta ever carries part of a marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar


class Phase(Enum):
    """Where the model's output is: before a possible start marker, thinking, or answering."""

    OPEN = "open"
    REASONING = "reasoning"
    ANSWER = "answer"


@dataclass(frozen=True)
class Split:
    """Text of one delta (or a whole answer): its reasoning part and its answer part."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """A model family's thinking format: `start` and `end` markers; `implicit_start` says whether output
    that does not open with `start` is thinking anyway (DeepSeek-R1's templates put `<think>` in the
    prompt, so the model may never write it) or is the answer (Qwen3 with thinking switched off)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = False

    def prompt_phase(self, prompt: str) -> Phase:
        """Where the rendered prompt leaves the model: its tail is an opened or a closed thinking block."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return Phase.ANSWER
        if tail.endswith(self.start):
            return Phase.REASONING
        return Phase.OPEN

    def stream(self, phase: Phase = Phase.OPEN) -> ReasoningStream:
        """A streaming split starting at `phase`."""
        return ReasoningStream(self, phase)

    def split(self, text: str, phase: Phase = Phase.OPEN) -> Split:
        """The whole output's reasoning and answer."""
        return self.stream(phase).feed(text, final=True)


class ReasoningStream:
    """One sequence's split as its text arrives; `feed` returns what is decided, holding a possible marker."""

    def __init__(self, parser: ReasoningParser, phase: Phase):
        self.parser = parser
        self.phase = phase
        self._held = ""
        self.saw_reasoning = phase is Phase.REASONING

    @property
    def answering(self) -> bool:
        """True once the output is past its thinking."""
        return self.phase is Phase.ANSWER

    def feed(self, text: str, final: bool = False) -> Split:
        """Split the new `text`; with `final`, nothing more comes and whatever was held is released."""
        buffer = self._held + text
        self._held = ""
        reasoning, content = [], []
        while buffer:
            if self.phase is Phase.ANSWER:
                content.append(buffer)
                break
            if self.phase is Phase.OPEN:
                buffer = self._open(buffer, final)
                if self.phase is Phase.OPEN:
                    break
                continue
            buffer = self._reasoning(buffer, final, reasoning)
            if self.phase is Phase.REASONING:
                break
        return Split("".join(reasoning), "".join(content))

    def _open(self, buffer: str, final: bool) -> str:
        """Decide whether the output opens a thinking block; returns the text left to split."""
        start = self.parser.start
        if buffer.startswith(start):
            self.phase, self.saw_reasoning = Phase.REASONING, True
            return buffer[len(start):]
        if start.startswith(buffer) and not final:
            self._held = buffer  # maybe the start marker, cut short
            return ""
        implicit = self.parser.implicit_start
        self.phase = Phase.REASONING if implicit else Phase.ANSWER
        self.saw_reasoning = implicit
        return buffer

    def _reasoning(self, buffer: str, final: bool, out: list[str]) -> str:
        """Thinking text up to the end marker goes to `out`; returns the text after the marker."""
        end = self.parser.end
        at = buffer.find(end)
        if at >= 0:
            out.append(buffer[:at])
            self.phase = Phase.ANSWER
            return buffer[at + len(end):]
        keep = 0 if final else _partial_suffix(buffer, end)
        out.append(buffer[:len(buffer) - keep])
        self._held = buffer[len(buffer) - keep:]
        return ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper head of `marker` (a marker maybe cut short)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
