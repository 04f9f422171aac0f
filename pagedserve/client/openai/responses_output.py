"""The Responses API's output: a chat choice turned into output items (reasoning, message, function calls),
whole or as the SDK's stream events in order, each with its sequence number."""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict) -> list[dict]:
    """A whole chat message's output items: its reasoning, its text, then its calls."""
    items = []
    if message.get("reasoning") is not None:
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or ""))
    items += [call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"])
              for call in calls]
    return items


def history_messages(items: list[dict]) -> list[dict]:
    """The chat messages a continued conversation renders for a response's output items."""
    messages: list[dict] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": item["content"][0]["text"] if item["content"] else ""})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


class EventWriter:
    """Chat deltas in, Responses stream events out: each output item is opened, filled and closed in turn."""

    def __init__(self):
        self.items: list[dict] = []  # the finished output items
        self._open: dict | None = None  # the item being streamed: kind, id, text (or arguments), call fields
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its output index
        self.sequence = 0

    def event(self, kind: str, **fields) -> dict:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return body

    def delta(self, delta: dict) -> list[dict]:
        """The events of one chat delta (reasoning, content or tool calls)."""
        events = []
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def close(self) -> list[dict]:
        """Close the item being streamed, if one is."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, item_id, text = len(self.items), item["id"], item["text"]
        events = []
        if item["kind"] == "reasoning":
            done = reasoning_item(item_id, text)
            events.append(self.event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                     content_index=0, text=text))
        elif item["kind"] == "message":
            done = message_item(item_id, text)
            events.append(self.event("response.output_text.done", item_id=item_id, output_index=index,
                                     content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item_id, output_index=index,
                                     content_index=0, part=done["content"][0]))
        else:
            done = call_item(item_id, item["call_id"], item["name"], text)
            events.append(self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                     arguments=text, name=item["name"]))
        self.items.append(done)
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        return events

    def _start(self, kind: str, item: dict, **fields) -> list[dict]:
        events = self.close()
        self._open = {"kind": kind, "id": item["id"], "text": "", **fields}
        index = len(self.items)
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["kind"] != kind:
            if kind == "message":
                item = message_item(new_id("msg"), None, "in_progress")
            else:
                item = reasoning_item(new_id("rs"), "", "in_progress")
            events += self._start(kind, item)
        self._open["text"] += text
        index, item_id = len(self.items), self._open["id"]
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                     content_index=0, delta=text))
        else:
            events.append(self.event("response.output_text.delta", item_id=item_id, output_index=index,
                                     content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call: dict) -> list[dict]:
        events = []
        function = call.get("function") or {}
        if call.get("id") is not None:  # a new call
            item = call_item(new_id("fc"), call["id"], function.get("name", ""), "", "in_progress")
            events += self._start("function_call", item, call_id=call["id"], name=item["name"])
            self._calls[call["index"]] = len(self.items)
        arguments = function.get("arguments") or ""
        if arguments and self._open is not None and self._open["kind"] == "function_call":
            self._open["text"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                     output_index=len(self.items), delta=arguments))
        return events
