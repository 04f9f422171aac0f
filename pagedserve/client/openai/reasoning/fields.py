"""The reasoning fields of a request and what the shim sends the llm model for them: whether the reply
shows the reasoning (`include_reasoning`), the thinking budget (`thinking_token_budget`, vLLM's name), and
`reasoning_effort` for templates that read it; with a constraint or a budget, the end marker's token ids,
so the engine's grammar starts after the thinking."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.client.openai.errors import bad_request
from pagedserve.client.openai.reasoning.base import Phase, ReasoningParser
from pagedserve.client.openai.reasoning.choice import ReasoningRequest

REASONING_FIELDS = {"include_reasoning", "thinking_token_budget", "reasoning_effort"}
EFFORTS = ("minimal", "low", "medium", "high")
# An assistant message sent back with its reasoning (our replies carry both names).
REASONING_KEYS = ("reasoning", "reasoning_content")


@dataclass(frozen=True)
class ReasoningFields:
    """A request's reasoning fields, checked."""

    include: bool = True
    budget: int | None = None
    effort: str | None = None


def parse_reasoning_fields(body: dict) -> ReasoningFields:
    """`include_reasoning`, `thinking_token_budget` and `reasoning_effort`, refused naming the field."""
    include = body.get("include_reasoning", True)
    if not isinstance(include, bool):
        raise bad_request("'include_reasoning' must be a boolean", "include_reasoning")
    budget = body.get("thinking_token_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise bad_request("'thinking_token_budget' must be an integer >= 0", "thinking_token_budget")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {list(EFFORTS)}", "reasoning_effort")
    return ReasoningFields(include, budget, effort)


def reasoning_request(parser: ReasoningParser | None, fields: ReasoningFields, prompt: str,
                      sampling: dict[str, Any], end_token_ids: list[int]) -> ReasoningRequest | None:
    """The request's reasoning split (None without a parser), and the end marker put into `sampling` when a
    constraint or a budget must wait for it; a budget without a parser is refused."""
    if parser is None:
        if fields.budget is not None:
            raise bad_request("'thinking_token_budget' needs a reasoning parser (serve with --reasoning-parser)",
                              "thinking_token_budget")
        return None
    phase = parser.prompt_phase(prompt)
    if phase is not Phase.ANSWER and (fields.budget is not None or "structured_outputs" in sampling):
        sampling["reasoning_end_token_ids"] = end_token_ids
        if fields.budget is not None:
            sampling["thinking_token_budget"] = fields.budget
    return ReasoningRequest(parser, phase, fields.include)


def history_reasoning(message: dict, where: str) -> dict:
    """A past assistant message's reasoning as `reasoning_content`, the name chat templates read (Qwen3's
    renders it, most drop it); refused on other roles or when it is not text."""
    given = [key for key in REASONING_KEYS if message.get(key) is not None]
    if not given:
        return {}
    key = given[-1]
    if message.get("role") != "assistant" or not isinstance(message[key], str):
        raise bad_request(f"'{where}.{key}' must be text, on an assistant message", f"{where}.{key}")
    return {"reasoning_content": message[key]}
