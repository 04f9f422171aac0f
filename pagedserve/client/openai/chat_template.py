"""A model folder's chat template, rendered as transformers' `apply_chat_template` renders it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedserve.client.openai.chat_options import cut_after_final_message
from pagedserve.client.openai.errors import bad_request


class ChatTemplate:
    """The model folder's chat template, rendered in jinja2's immutable sandbox as transformers does."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", tool_source: str | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        # A folder's named "tool_use" template is the one transformers renders when tools are given.
        self._tool_template = env.from_string(tool_source) if tool_source else self._template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """Read `chat_template.jinja`, `chat_template.json` or tokenizer_config.json's `chat_template`."""
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        source, tool_source = config.get("chat_template"), None
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source, tool_source = named.get("default"), named.get("tool_use")
        if (folder / "chat_template.json").exists():
            source = json.loads((folder / "chat_template.json").read_text()).get("chat_template", source)
        if (folder / "chat_template.jinja").exists():
            source = (folder / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source:
            raise FileNotFoundError(f"no chat template in {folder}")
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
                   tool_source if isinstance(tool_source, str) else None)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The prompt text for these messages and tools; a template error is the caller's 400 on `messages`.
        `continue_final_message` ends the text inside the final message, for the model to go on with it."""
        template = self._template if tools is None else self._tool_template
        try:
            rendered = template.render(
                **template_kwargs,
                messages=messages,
                tools=tools,
                documents=None,  # transformers passes both, None when absent, so `is none` tests agree
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as error:
            raise bad_request(f"chat template failed for these messages: {error}", "messages") from error
        if continue_final_message:
            return cut_after_final_message(rendered, messages[-1].get("content") or "")
        return rendered


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: JSON without jinja's HTML escaping, with json.dumps' options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _token_text(token: Any) -> str:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
