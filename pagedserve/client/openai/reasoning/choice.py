"""One choice's reasoning as its llm responses arrive: the split of each response's text, the whole
reasoning and answer kept for a non-streamed reply, and how many output tokens the thinking took."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.client.openai.reasoning.base import Phase, ReasoningParser, Split


@dataclass(frozen=True)
class ReasoningRequest:
    """What a request asks of the reasoning parser: the phase its prompt leaves the model in, whether the
    reply shows the reasoning (include_reasoning), and the parser."""

    parser: ReasoningParser
    phase: Phase
    include: bool = True


class ChoiceReasoning:
    """The reasoning of one choice; `absorb` takes each response's new text in order."""

    def __init__(self, request: ReasoningRequest):
        self._stream = request.parser.stream(request.phase)
        self.include = request.include
        self.reasoning = ""
        self.content = ""
        # Output tokens up to the response that closed the thinking (counted per llm response).
        self.reasoning_tokens = 0

    @property
    def saw_reasoning(self) -> bool:
        return self._stream.saw_reasoning

    def absorb(self, text: str, finished: bool, num_output_tokens: int) -> Split:
        """Split one response's new text; `num_output_tokens` is the choice's count after it."""
        thinking = not self._stream.answering
        split = self._stream.feed(text, final=finished)
        if thinking and self._stream.saw_reasoning:
            self.reasoning_tokens = num_output_tokens
        self.reasoning += split.reasoning
        self.content += split.content
        return split

    def message_fields(self) -> dict:
        """The whole reply's reasoning fields: `reasoning` and its older name `reasoning_content`."""
        if not self.include:
            return {}
        text = self.reasoning if self.saw_reasoning else None
        return {"reasoning": text, "reasoning_content": text}

    def delta_fields(self, split: Split) -> dict:
        """A streamed delta's reasoning fields (none when it brings no reasoning or it is not shown)."""
        if not self.include or not split.reasoning:
            return {}
        return {"reasoning": split.reasoning, "reasoning_content": split.reasoning}
