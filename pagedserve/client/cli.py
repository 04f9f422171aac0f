"""The `pagedserve` command: serve, openai, generate, chat, bench, embed, rerank.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported lazily so `pagedserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedserve.client.launcher", "start tritonserver with the pagedserve model repository"),
    "openai": ("pagedserve.client.openai", "run the OpenAI-compatible shim against a tritonserver"),
    "generate": ("pagedserve.client.commands", "generate text for one prompt"),
    "chat": ("pagedserve.client.commands", "interactive chat in the terminal"),
    "bench": ("pagedserve.client.bench", "online load generator (Triton gRPC or an OpenAI URL)"),
    "embed": ("pagedserve.client.pooling_commands", "embed texts with a pooling model (one JSON line each)"),
    "rerank": ("pagedserve.client.pooling_commands", "rank documents against a query with a cross-encoder"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one subcommand."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p, name) if _takes_name(module) else module.add_arguments(p)
            p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    return int(args._module.run(args) or 0)


def _takes_name(module) -> bool:
    """Modules serving several subcommands (generate, chat) take the subcommand name too."""
    return getattr(module, "MULTI_COMMAND", False)


if __name__ == "__main__":
    raise SystemExit(main())
