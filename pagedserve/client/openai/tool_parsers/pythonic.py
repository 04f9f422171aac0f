"""Pythonic tool calls (Llama 3.2 / 4, ToolACE): the whole output is a Python list of calls,
`[get_weather(city="Paris"), get_time()]`, optionally inside `<|python_start|>` ... `<|python_end|>`."""

from __future__ import annotations

import ast

from pagedserve.client.openai.tool_parsers.base import Scan, ToolCall, ToolParser, normalized_arguments

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    """Calls only when the whole output is a list of calls with literal keyword arguments, read with `ast`
    (nothing is evaluated); anything else is content. Text that could still open such a list is held."""

    name = "pythonic"

    def scan(self, text: str, final: bool) -> Scan:
        if not final:
            return Scan() if _could_open_call_list(text) else Scan(text)
        calls = _calls(text) if _could_open_call_list(text) else []  # the same start rule as streaming
        return Scan("", calls) if calls else Scan(text)


def _could_open_call_list(text: str) -> bool:
    """Whether `text` is, or may grow into, a start `[name(` of a list of calls."""
    text = text.lstrip()
    if PYTHON_START.startswith(text):
        return True
    if text.startswith(PYTHON_START):
        text = text[len(PYTHON_START):].lstrip()
    if not text:
        return True
    if text[0] != "[":
        return False
    rest = text[1:].lstrip()
    if not rest:
        return True
    if not (rest[0].isalpha() or rest[0] == "_"):
        return False
    name_end = 1
    while name_end < len(rest) and (rest[name_end].isalnum() or rest[name_end] == "_"):
        name_end += 1
    after = rest[name_end:].lstrip()
    return not after or after[0] == "("


def _calls(text: str) -> list[ToolCall]:
    """The calls of a whole output that is a list of calls; [] when it is anything else."""
    source = text.strip()
    if source.startswith(PYTHON_START):
        source = source[len(PYTHON_START):]
        source = source[: -len(PYTHON_END)] if source.endswith(PYTHON_END) else source
    source = source.strip()
    if not source.startswith("["):
        return []
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return []
    calls = [_call(node) for node in tree.body.elts]
    return [] if any(call is None for call in calls) else calls


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    text = normalized_arguments(arguments)
    return None if text is None else ToolCall(node.func.id, text)
