"""`pagedserve generate` (one prompt, optionally streamed) and `pagedserve chat` (interactive, in the terminal).

Both talk to tritonserver's `llm` model over gRPC; Ctrl-C cancels the running request on the server.
With `--json-schema FILE`, `--regex PATTERN` or `--choice TEXT` (repeated) every reply is constrained to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pagedserve.client.triton_client import TritonLLMClient, TritonRequestError, TritonUnavailableError

MULTI_COMMAND = True
DEFAULT_TRITON_URL = "localhost:8001"
EXIT_WORDS = {"exit", "quit", "/exit", "/quit"}


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Flags of `generate` (a prompt argument) and `chat` (a system prompt and the model folder)."""
    if name == "generate":
        parser.add_argument("prompt", help="the prompt text")
        parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    else:
        parser.add_argument("--system", default=None, help="system message that starts the conversation")
        parser.add_argument("--model", default=None, help="model folder or .gguf file for the chat template (default: ask Triton)")
    parser.add_argument("--url", default=DEFAULT_TRITON_URL, help="tritonserver gRPC address HOST:PORT")
    parser.add_argument("--max-tokens", type=int, default=None if name == "chat" else 64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--presence-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    _add_structured_arguments(parser)


def _add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    """At most one output constraint; argparse itself refuses two (exit code 2, both flags named)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", type=_json_schema_file, default=None, metavar="FILE",
                       help="reply with JSON valid against the JSON Schema in FILE")
    group.add_argument("--regex", default=None, metavar="PATTERN", help="reply with text matching PATTERN")
    group.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="reply with exactly one of the choices (repeat: --choice yes --choice no)")


def _json_schema_file(path: str) -> dict | bool:
    """The JSON Schema read from `path`; argparse reports a failure as `argument --json-schema: ...`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise argparse.ArgumentTypeError(f"cannot read {path}: {reason}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        kind = type(schema).__name__
        raise argparse.ArgumentTypeError(f"{path} must hold a JSON Schema object, got {kind}")
    return schema


def sampling_parameters(args: argparse.Namespace) -> dict:
    """The `sampling_parameters` JSON of the flags that were given (the server validates them)."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "stop")
    params = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    params.setdefault("max_tokens", None)
    spec = structured_outputs(args)
    if spec is not None:
        params["structured_outputs"] = spec
    return params


def structured_outputs(args: argparse.Namespace) -> dict | None:
    """The llm model's `structured_outputs` spec of --json-schema, --regex or --choice (None without one)."""
    for flag, kind in (("json_schema", "json"), ("regex", "regex"), ("choice", "choice")):
        value = getattr(args, flag, None)
        if value is not None:
            return {kind: value}
    return None


def run(args: argparse.Namespace) -> int:
    """Run `generate` or `chat`; 1 on a refused request, 2 when the server cannot be reached."""
    work = _generate(args) if hasattr(args, "prompt") else _chat(args)
    try:
        return asyncio.run(work)
    except TritonRequestError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 1
    except TritonUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def _generate(args: argparse.Namespace) -> int:
    client = TritonLLMClient(args.url)
    try:
        stream = client.generate(args.prompt, sampling_parameters=sampling_parameters(args), stream=args.stream)
        async for response in stream:
            sys.stdout.write(response.text[0])
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    finally:
        await client.close()


async def _chat(args: argparse.Namespace) -> int:
    from pagedserve.client.model_repository import tokenizer_folder
    from pagedserve.client.openai.chat_template import ChatTemplate

    client = TritonLLMClient(args.url)
    try:
        folder = args.model or (await client.model_parameters()).get("model")
        if not folder:
            print("error: the llm model names no model folder; pass --model", file=sys.stderr)
            return 2
        # A .gguf file (the default model's default form) keeps its template in the folder made from its metadata.
        template = ChatTemplate.from_model_dir(tokenizer_folder(folder))
        messages = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin.isatty()
        if interactive:
            print("pagedserve chat: an empty line or 'exit' quits; Ctrl-C stops the reply and quits", file=sys.stderr)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, _read_line, "you> " if interactive else "")
            if line is None or line.strip() in EXIT_WORDS or (interactive and not line.strip()):
                return 0
            messages.append({"role": "user", "content": line})
            reply = await _stream_reply(client, template.render(messages), args, interactive)
            messages.append({"role": "assistant", "content": reply})
    finally:
        await client.close()


async def _stream_reply(client: TritonLLMClient, prompt: str, args: argparse.Namespace, interactive: bool) -> str:
    """Print one assistant reply as it streams and return its text."""
    if interactive:
        sys.stdout.write("assistant> ")
    parts = []
    # The rendered template holds the special tokens it wants: none are added on top (as in vLLM's chat API).
    async for response in client.generate(prompt, sampling_parameters=sampling_parameters(args), stream=True,
                                          add_special_tokens=False):
        parts.append(response.text[0])
        sys.stdout.write(response.text[0])
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def _read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None
