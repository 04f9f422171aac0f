"""`pagedserve generate` (one prompt, optionally streamed) and `pagedserve chat` (interactive, in the terminal).

Both talk to tritonserver's `llm` model over gRPC; Ctrl-C cancels the running request on the server.
With `--json-schema FILE`, `--regex PATTERN` or `--choice TEXT` (repeated) every reply is constrained to it.
With `--image FILE` (repeated) the images go to the llm model's `image` input: `generate`'s prompt holds the
model's placeholders itself; `chat` puts one placeholder an image (the processor's image token) before the first
message's text and sends the images with every turn, as the conversation's prompt holds them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
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
    parser.add_argument("--image", action="append", type=_image_file, default=[], metavar="FILE",
                        help="an image for a vision-language model (repeatable; generate: the prompt holds the "
                             "model's placeholder for each, e.g. <image>)")
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


def _image_file(path: str) -> str:
    """The base64 of image file `path` (the llm model's `image` element); argparse reports a failure."""
    try:
        return base64.b64encode(Path(path).read_bytes()).decode("ascii")
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error.strerror or error}") from None


def with_image_placeholders(text: str, count: int, folder: str | Path) -> str:
    """The first user message's text after one image placeholder an image (the model processor's token)."""
    if not count:
        return text
    from pagedserve.client.openai.images import image_placeholder

    placeholder = image_placeholder(str(folder))
    if placeholder is None:
        raise ValueError(f"the model in {folder} takes no images (no processor with an image token)")
    return "".join(f"{placeholder}\n" for _ in range(count)) + text


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
        stream = client.generate(args.prompt, sampling_parameters=sampling_parameters(args), stream=args.stream,
                                 images=args.image or None)
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
        try:
            first = with_image_placeholders("", len(args.image), tokenizer_folder(folder))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        messages = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin.isatty()
        if interactive:
            print("pagedserve chat: an empty line or 'exit' quits; Ctrl-C stops the reply and quits", file=sys.stderr)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, _read_line, "you> " if interactive else "")
            if line is None or line.strip() in EXIT_WORDS or (interactive and not line.strip()):
                return 0
            if not any(message["role"] == "user" for message in messages):
                line = first + line
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
                                          add_special_tokens=False, images=args.image or None):
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
