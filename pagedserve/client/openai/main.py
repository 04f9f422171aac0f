"""Command line of the shim: `pagedserve openai` and `python -m pagedserve.client.openai`."""

from __future__ import annotations

import argparse
import os

from pagedserve.client.media_options import add_media_arguments, image_limit
from pagedserve.client.openai.lora import (
    RUNTIME_UPDATES_ENV,
    RUNTIME_UPDATES_FLAG,
    LoRASettings,
    runtime_updates_from_env,
)
from pagedserve.client.openai.media import MediaSettings
from pagedserve.client.openai.reasoning import REASONING_PARSERS
from pagedserve.client.openai.shim import DEFAULT_MAX_BODY_BYTES, ShimSettings
from pagedserve.client.openai.tool_parsers import TOOL_PARSERS
from pagedserve.client.openai.tools import ToolSettings

DEFAULT_PORT = 9000
# The key is better read from the environment than from a command line that `ps` shows.
API_KEY_ENV = "PAGEDSERVE_API_KEY"
DESCRIPTION = "OpenAI-compatible HTTP shim (FastAPI) in front of tritonserver's decoupled `llm` model."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pagedserve openai` and `python -m pagedserve.client.openai`."""
    parser.add_argument("--triton-url", default="localhost:8001", help="tritonserver gRPC address HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})")
    parser.add_argument("--model-name", nargs="+", default=None, metavar="NAME",
                        help="model id served on /v1/models; more names are aliases it also answers to")
    parser.add_argument("--model", default=None, help="model folder (chat template); default: ask Triton")
    parser.add_argument("--metrics-url", default=None, help="Triton metrics URL (default: HOST:8002/metrics)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--log-level", default="warning")
    add_tool_arguments(parser)
    parser.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                        help="/v1/responses keeps at most N stored responses (the oldest is evicted)")
    parser.add_argument("--responses-store-max-age", type=float, default=3600.0, metavar="SECONDS",
                        help="/v1/responses forgets a stored response after SECONDS")
    parser.add_argument(RUNTIME_UPDATES_FLAG, action="store_true", default=runtime_updates_from_env(),
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                             f"${RUNTIME_UPDATES_ENV}, as vLLM reads it)")
    parser.add_argument("--lora-separator", default=None, metavar="SEP",
                        help="a model name MODEL<SEP>ADAPTER names a LoRA adapter too (Triton's OpenAI frontend)")
    add_media_arguments(parser)


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags."""
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (the default when tools are sent): parse the calls the '
                             "model writes with --tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the model's tool-call format: hermes (Qwen2.5, Hermes), llama3_json, mistral, pythonic")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='do not show the tools to the chat template when tool_choice is "none"')
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split the model's thinking from its answer (reasoning / reasoning_content): "
                             + ", ".join(sorted(REASONING_PARSERS)))


def tool_settings(args: argparse.Namespace) -> ToolSettings:
    """The tool flags checked as vLLM checks them: auto tool choice needs a parser."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice requires --tool-call-parser")
    return ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser, args.exclude_tools_when_tool_choice_none)


def run(args: argparse.Namespace) -> int:
    """Serve the shim until interrupted."""
    import uvicorn

    from pagedserve.client.openai.app import create_app

    settings = ShimSettings(
        triton_url=args.triton_url,
        model_name=args.model_name[0] if args.model_name else None,
        aliases=tuple(args.model_name[1:]) if args.model_name else (),
        model_path=args.model,
        api_key=args.api_key,
        metrics_url=args.metrics_url,
        max_body_bytes=args.max_body_bytes,
        tools=tool_settings(args),
        lora=LoRASettings(args.enable_lora_runtime_updates, args.lora_separator or None),
        reasoning_parser=args.reasoning_parser,
        responses_store_size=args.responses_store_size,
        responses_store_max_age_s=args.responses_store_max_age,
        media=MediaSettings(tuple(args.allowed_media_domains), args.media_fetch_timeout, args.media_max_bytes,
                            image_limit(args) if args.limit_mm_per_prompt is not None else None),
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m pagedserve.client.openai`."""
    parser = argparse.ArgumentParser(prog="pagedserve-openai", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
