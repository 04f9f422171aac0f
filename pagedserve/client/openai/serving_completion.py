"""/v1/completions: text choices, legacy logprobs with text offsets, and the echoed prompt."""

from __future__ import annotations

from pagedserve.client.openai.formats import completion_logprobs
from pagedserve.client.openai.generation import ChoiceState, Generation, SequenceUpdate
from pagedserve.client.openai.protocol import CompletionRequest, parse_completion_request
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.triton_client import LLMResponse


class CompletionGeneration(Generation):
    """A completion's answer: each choice's text, after its prompt's when the request echoes it."""

    id_prefix = "cmpl-"
    object_name = chunk_object_name = "text_completion"
    parse = staticmethod(parse_completion_request)

    def __init__(self, shim: OpenAIShim, request: CompletionRequest):
        super().__init__(shim, request)
        self.request: CompletionRequest = request
        self.hides_output = request.echo_only
        self._echo_texts: list[str] = []
        # Echoed prompts not streamed yet, by prompt index.
        self._unsent_echoes: dict[int, str] = {}

    async def _start(self) -> None:
        if self.request.echo:
            self._echo_texts = [p if isinstance(p, str) else await self.shim.decode(p) for p in self.request.prompts]
            self._unsent_echoes = dict(enumerate(self._echo_texts))

    def _opening_chunks(self) -> list[dict]:
        # With logprobs, each echo waits for its prompt's first response, which brings the prompt's logprobs.
        if self.request.logprobs is not None:
            return []
        return [chunk for prompt_index in list(self._unsent_echoes) for chunk in self._echo_chunks(prompt_index, [])]

    def _prompt_chunks(self, prompt_index: int, response: LLMResponse) -> list[dict]:
        if prompt_index in self._unsent_echoes and response.prompt_logprobs is not None:
            return self._echo_chunks(prompt_index, response.prompt_logprobs)
        return []

    def _echo_chunks(self, prompt_index: int, entries: list[dict]) -> list[dict]:
        """The echoed prompt as the first chunk of each of its choices, with its token logprobs if asked."""
        text = self._unsent_echoes.pop(prompt_index)
        return [self._chunk(_text_choice(index, text, self._logprobs(entries, self.choices[index]), None))
                for index in self.choice_indices(prompt_index)]

    def _choice(self, index: int, state: ChoiceState) -> dict:
        text, entries = state.text, state.logprobs
        if self._echo_texts:
            prompt_index = index // self.request.n
            text, entries = self._echo_texts[prompt_index] + text, self.prompt_logprobs[prompt_index] + entries
        return _text_choice(index, text, self._logprobs(entries, state), state.finish_reason)

    def _delta_chunks(self, update: SequenceUpdate) -> list[dict]:
        logprobs = self._logprobs(update.entries, self.choices[update.index])
        return [self._chunk(_text_choice(update.index, update.text, logprobs, update.finish))]

    def _logprobs(self, entries: list[dict], state: ChoiceState) -> dict | None:
        """The legacy logprobs of `entries`, which follow the choice's text so far."""
        if self.request.logprobs is None:
            return None
        body = completion_logprobs(entries, self.request.logprobs, state.text_offset)
        state.text_offset += sum(len(e["token"]) for e in entries)
        return body


def _text_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
