"""/v1/chat/completions: the messages rendered with the model's chat template, assistant messages and
deltas, and chat's logprobs shape."""

from __future__ import annotations

from pagedserve.client.openai.chat_options import echoed_text
from pagedserve.client.openai.formats import chat_logprobs
from pagedserve.client.openai.generation import ChoiceState, Generation, SequenceUpdate
from pagedserve.client.openai.images import with_placeholders
from pagedserve.client.openai.media import image_limit_of, resolve_images
from pagedserve.client.openai.protocol import ChatRequest, parse_chat_request
from pagedserve.client.openai.reasoning import Split
from pagedserve.client.openai.reasoning.choice import ChoiceReasoning
from pagedserve.client.openai.reasoning.fields import reasoning_request
from pagedserve.client.openai.shim import OpenAIShim
from pagedserve.client.openai.tools import (
    ChoiceTools,
    check_served,
    finish_reason,
    output_parser,
    template_tools,
)
from pagedserve.client.triton_client import LLMResponse


class ChatGeneration(Generation):
    """A chat completion's answer: one assistant message per choice, streamed as deltas after a role."""

    id_prefix = "chatcmpl-"
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"
    parse = staticmethod(parse_chat_request)
    request: ChatRequest

    def __init__(self, shim: OpenAIShim, request: ChatRequest):
        super().__init__(shim, request)
        parser = output_parser(request.tools, shim.settings.tools)
        # Each choice's tool calls, read from its text; None: the text is the content.
        self._tools = [None if parser is None else ChoiceTools(parser, request.tools.parallel_tool_calls)
                       for _ in self.choices]
        # Each choice's thinking apart from its answer (None: no reasoning parser); the split of its newest text.
        self._reasoning = [None if request.reasoning is None else ChoiceReasoning(request.reasoning)
                           for _ in self.choices]
        self._splits: dict[int, Split] = {}

    @classmethod
    async def llm_prompts(cls, shim: OpenAIShim, request: ChatRequest) -> list[str | list[int]]:
        check_served(request.tools, shim.settings.tools)
        tools = template_tools(request.tools, shim.settings.tools)
        options = request.options
        prompt = (await shim.chat_template()).render(
            request.messages, options.add_generation_prompt, tools=tools,
            continue_final_message=options.continue_final_message, **options.template_kwargs)
        parser = shim.reasoning_parser
        end_ids = [] if parser is None else await shim.reasoning_end_ids(parser)
        request.reasoning = reasoning_request(parser, request.reasoning_fields, prompt, request.sampling, end_ids)
        prompt = with_placeholders(prompt, await shim.model_dir())  # each image part's marker: the model's own
        request.images = await resolve_images(request.images, request.image_params, shim.settings.media,
                                              await image_limit_of(shim) if request.images else None)
        request.stream_upstream = request.reasoning is not None  # per-step counts: the reasoning's tokens
        return [prompt]

    def usage(self) -> dict:
        usage = super().usage()
        if self.request.reasoning is not None:
            tokens = sum(r.reasoning_tokens for r in self._reasoning if r is not None)
            usage["completion_tokens_details"] = {"reasoning_tokens": tokens}
        return usage

    def _absorb(self, prompt_index: int, response: LLMResponse) -> list[SequenceUpdate]:
        updates = super()._absorb(prompt_index, response)
        for update in updates:
            reasoning = self._reasoning[update.index]
            if reasoning is not None:
                count = self.choices[update.index].num_output_tokens
                self._splits[update.index] = reasoning.absorb(update.text, update.finish is not None, count)
        return updates

    def _opening_chunks(self) -> list[dict]:
        chunks = [self._chunk(_delta_choice(index, {"role": "assistant", "content": ""}, None, None))
                  for index in range(len(self.choices))]
        echo = echoed_text(self.request.options, self.request.messages)
        if echo:
            for index, tools in enumerate(self._tools):
                # With tools, the echo is the start of the text the parser reads, as the whole answer reads it.
                deltas = [{"content": echo}] if tools is None else tools.deltas(echo, finished=False)
                chunks += [self._chunk(_delta_choice(index, delta, None, None)) for delta in deltas]
        return chunks

    def _choice(self, index: int, state: ChoiceState) -> dict:
        reasoning = self._reasoning[index]
        answer = state.text if reasoning is None else reasoning.content
        text = echoed_text(self.request.options, self.request.messages) + answer
        message = {"role": "assistant", "content": text, "refusal": None}
        if reasoning is not None:
            message.update(reasoning.message_fields())
        tools, finish = self._tools[index], state.finish_reason
        if tools is not None:
            message["content"], calls = tools.message(text)
            if calls:
                message["tool_calls"], finish = calls, finish_reason(True, finish)
        return {"index": index, "message": message, "logprobs": self._logprobs(state.logprobs),
                "finish_reason": finish}

    def _delta_chunks(self, update: SequenceUpdate) -> list[dict]:
        """The reasoning delta (logprobs on it) then the answer's deltas of one update."""
        reasoning = self._reasoning[update.index]
        if reasoning is None:
            return self._answer_chunks(update)
        split = self._splits.pop(update.index, Split())
        answer = update._replace(text=split.content)
        fields = reasoning.delta_fields(split)
        if not fields:
            return self._answer_chunks(answer) if answer.text or answer.entries or answer.finish else []
        chunks = [self._chunk(_delta_choice(update.index, fields, self._logprobs(update.entries), None))]
        if answer.text or answer.finish is not None:
            chunks += self._answer_chunks(answer._replace(entries=[]))
        return chunks

    def _answer_chunks(self, update: SequenceUpdate) -> list[dict]:
        if self._tools[update.index] is not None:
            return self._tool_delta_chunks(update, self._tools[update.index])
        delta = {"content": update.text} if update.text else {}
        logprobs = self._logprobs(update.entries)
        if update.finish is not None and update.text:
            # The finish reason comes in a chunk of its own with an empty delta, as OpenAI sends it.
            return [self._chunk(_delta_choice(update.index, delta, logprobs, None)),
                    self._chunk(_delta_choice(update.index, {}, None, update.finish))]
        return [self._chunk(_delta_choice(update.index, delta, logprobs, update.finish))]

    def _tool_delta_chunks(self, update: SequenceUpdate, tools: ChoiceTools) -> list[dict]:
        """The content and call deltas the parser lets out; logprobs ride on the first chunk (an empty delta
        when the text is held), the finish on a chunk of its own."""
        logprobs = self._logprobs(update.entries)
        deltas = tools.deltas(update.text, update.finish is not None)
        if not deltas and logprobs is not None:
            deltas = [{}]
        chunks = [self._chunk(_delta_choice(update.index, delta, logprobs if i == 0 else None, None))
                  for i, delta in enumerate(deltas)]
        if update.finish is not None:
            finish = finish_reason(tools.called, update.finish)
            chunks.append(self._chunk(_delta_choice(update.index, {}, None, finish)))
        return chunks

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return None if self.request.logprobs is None else chat_logprobs(entries, self.request.logprobs)


def _delta_choice(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
