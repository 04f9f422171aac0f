"""`serve`'s checks of the shim's flags at parse time, before anything starts; the shim's modules are imported
only when such a flag is given (`pagedserve --help` stays light)."""

from __future__ import annotations

import argparse


def reasoning_parser_name(name: str) -> str:
    """An argparse type: a --reasoning-parser name the shim knows, else a usage error listing them."""
    from pagedserve.client.openai.reasoning import REASONING_PARSERS

    if name not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(f"unknown reasoning parser {name!r}; choose from "
                                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return name
