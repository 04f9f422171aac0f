"""/v1/chat/completions: the messages rendered with the model's chat template, assistant messages and
deltas, and chat's logprobs shape."""

from __future__ import annotations

from pagedserve.client.openai.formats import chat_logprobs
from pagedserve.client.openai.generation import ChoiceState, Generation, SequenceUpdate
from pagedserve.client.openai.protocol import ChatRequest, parse_chat_request
from pagedserve.client.openai.shim import OpenAIShim


class ChatGeneration(Generation):
    """A chat completion's answer: one assistant message per choice, streamed as deltas after a role."""

    id_prefix = "chatcmpl-"
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"
    parse = staticmethod(parse_chat_request)
    request: ChatRequest

    @classmethod
    async def llm_prompts(cls, shim: OpenAIShim, request: ChatRequest) -> list[str | list[int]]:
        return [(await shim.chat_template()).render(request.messages)]

    def _opening_chunks(self) -> list[dict]:
        return [self._chunk(_delta_choice(index, {"role": "assistant", "content": ""}, None, None))
                for index in range(len(self.choices))]

    def _choice(self, index: int, state: ChoiceState) -> dict:
        message = {"role": "assistant", "content": state.text, "refusal": None}
        return {"index": index, "message": message, "logprobs": self._logprobs(state.logprobs),
                "finish_reason": state.finish_reason}

    def _delta_chunks(self, update: SequenceUpdate) -> list[dict]:
        delta = {"content": update.text} if update.text else {}
        logprobs = self._logprobs(update.entries)
        if update.finish is not None and update.text:
            # The finish reason comes in a chunk of its own with an empty delta, as OpenAI sends it.
            return [self._chunk(_delta_choice(update.index, delta, logprobs, None)),
                    self._chunk(_delta_choice(update.index, {}, None, update.finish))]
        return [self._chunk(_delta_choice(update.index, delta, logprobs, update.finish))]

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return None if self.request.logprobs is None else chat_logprobs(entries, self.request.logprobs)


def _delta_choice(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
