"""Command line of the shim: `pagedserve openai` and `python -m pagedserve.client.openai`."""

from __future__ import annotations

import argparse
import os

from pagedserve.client.openai.shim import DEFAULT_MAX_BODY_BYTES, ShimSettings

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
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m pagedserve.client.openai`."""
    parser = argparse.ArgumentParser(prog="pagedserve-openai", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
