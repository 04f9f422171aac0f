"""What both endpoints' answers share: llm responses absorbed into choices, and those choices framed as
one body or as SSE chunks. An endpoint (serving_completion, serving_chat) fills in the hooks below."""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from pagedserve.client.openai.errors import TRITON_ERRORS, triton_api_error
from pagedserve.client.openai.formats import SSE_DONE, sse_event, usage_body
from pagedserve.client.openai.protocol import GenerationRequest
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.triton_client import LLMResponse


@dataclass
class ChoiceState:
    """What one choice has produced so far (the whole text is kept only for non-streamed answers)."""

    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    text_offset: int = 0


class SequenceUpdate(NamedTuple):
    """What one llm response brought one choice: new text, new logprob entries, the finish if it ended."""

    index: int
    text: str
    entries: list[dict]
    finish: str | None


class Generation(ABC):
    """One OpenAI request's answer, built from its llm responses (one stream per prompt, merged).

    An endpoint names its objects, parses its body, shapes a choice whole (`_choice`) and as the chunks of
    one update (`_delta_chunks`), and may send chunks before any response or a prompt's first one."""

    id_prefix: ClassVar[str]
    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]
    parse: ClassVar[Callable[[dict], GenerationRequest]]

    def __init__(self, shim: OpenAIShim, request: GenerationRequest):
        self.shim, self.request = shim, request
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(len(request.prompts) * request.n)]
        self.prompt_tokens = [0] * len(request.prompts)
        # Each prompt's token logprob entries, from its first response when the request asks for them.
        self.prompt_logprobs: list[list[dict]] = [[] for _ in request.prompts]
        # Whether the generated tokens are left out of the answer (an echo of the prompt alone).
        self.hides_output = False

    @classmethod
    async def create(cls, shim: OpenAIShim, body: dict) -> Generation:
        """The answer to `body`: parsed, its model checked, its llm prompts ready to send."""
        request = cls.parse(body)
        lora_name = await shim.resolve_model(request.model)
        if lora_name is not None:
            request.sampling["lora_name"] = lora_name
        request.prompts = await cls.llm_prompts(shim, request)
        return cls(shim, request)

    @classmethod
    async def llm_prompts(cls, shim: OpenAIShim, request: GenerationRequest) -> list[str | list[int]]:
        """The prompts sent to the llm model, one request each."""
        return request.prompts

    async def _start(self) -> None:
        """What the answer needs before the first response is read: nothing, unless an endpoint says."""
        return None

    def _opening_chunks(self) -> list[dict]:
        """Chunks streamed before any response is read."""
        return []

    def _prompt_chunks(self, prompt_index: int, response: LLMResponse) -> list[dict]:
        """Chunks streamed on a response of prompt `prompt_index`, before its new output."""
        return []

    @abstractmethod
    def _choice(self, index: int, state: ChoiceState) -> dict:
        """Choice `index` of the non-streamed answer."""

    @abstractmethod
    def _delta_chunks(self, update: SequenceUpdate) -> list[dict]:
        """The chunks streamed for one update that brings text, logprobs or a finish."""

    def choice_indices(self, prompt_index: int) -> range:
        """The choices of one prompt (n per prompt, in prompt order)."""
        return range(prompt_index * self.request.n, (prompt_index + 1) * self.request.n)

    def usage(self) -> dict:
        """Usage summed over every prompt and choice so far."""
        return usage_body(sum(self.prompt_tokens), sum(c.num_output_tokens for c in self.choices))

    async def run(self, stream: AsyncIterator[tuple[int, LLMResponse]]) -> dict:
        """Collect a whole non-streamed answer."""
        await self._start()
        async for prompt_index, response in stream:
            self._absorb(prompt_index, response)
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.request.model,
            "choices": [self._choice(index, state) for index, state in enumerate(self.choices)],
            "usage": self.usage(),
            "system_fingerprint": None,
        }

    async def chunks(self, stream: AsyncIterator[tuple[int, LLMResponse]]) -> AsyncIterator[str]:
        """The SSE events of a streamed answer, ending with the usage chunk (if asked) and [DONE]."""
        await self._start()
        for chunk in self._opening_chunks():
            yield sse_event(chunk)
        try:
            async for prompt_index, response in stream:
                for chunk in self._response_chunks(prompt_index, response):
                    yield sse_event(chunk)
        except TRITON_ERRORS as error:
            yield sse_event(triton_api_error(error, self.request.param_renames).body())
            yield SSE_DONE
            return
        if self.request.include_usage:
            usage_chunk = self._chunk(None)
            usage_chunk["usage"] = self.usage()
            yield sse_event(usage_chunk)
        yield SSE_DONE

    def _chunk(self, choice: dict | None) -> dict:
        """A streamed chunk holding `choice` (none for the usage chunk)."""
        chunk = {
            "id": self.id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.request.model,
            "choices": [] if choice is None else [choice],
            "system_fingerprint": None,
        }
        if self.request.include_usage:
            continuous = choice is not None and self.request.stream_options.continuous_usage
            chunk["usage"] = self.usage() if continuous else None
        return chunk

    def _response_chunks(self, prompt_index: int, response: LLMResponse) -> list[dict]:
        chunks = self._prompt_chunks(prompt_index, response)
        for update in self._absorb(prompt_index, response):
            if update.text or update.entries or update.finish is not None:
                chunks.extend(self._delta_chunks(update))
        return chunks

    def _absorb(self, prompt_index: int, response: LLMResponse) -> list[SequenceUpdate]:
        """Record one response; returns the update of each choice it brought output for."""
        if response.num_input_tokens is not None:
            self.prompt_tokens[prompt_index] = response.num_input_tokens
        if response.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = response.prompt_logprobs
        updates = []
        for i, text in enumerate(response.text):
            index = self.choice_indices(prompt_index)[i]
            state = self.choices[index]
            if state.finish_reason is not None:
                continue  # the llm model repeats an ended completion's finish reason in later responses
            entries = response.logprobs[i] if response.logprobs is not None else []
            finish = response.finish_reason[i]
            if self.hides_output:
                text, entries, finish = "", [], finish and "length"
            if not self.request.stream:
                state.text += text
                state.logprobs.extend(entries)
            if response.num_output_tokens is not None and not self.hides_output:
                state.num_output_tokens = response.num_output_tokens[i]
            if finish is not None:
                state.finish_reason = finish
            updates.append(SequenceUpdate(index, text, entries, finish))
        return updates
