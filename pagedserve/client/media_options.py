"""The OpenAI shim's media flags, shared by `pagedserve openai` and `pagedserve serve` (which hands them on):
which hosts an http(s) `image_url` may be fetched from (vLLM's `--allowed-media-domains`; none by default), the
fetch's size and time limits, and `--limit-mm-per-prompt` as vLLM spells it (`'{"image": N}'`).

limit_mm_per_prompt is also an engine parameter (core/config.py; `serve`'s --limit-mm-per-prompt is that one's flag,
handed to the shim as well): the shim counts a request's images before any is fetched or sent, by its flag or else
the llm model's parameter; the llm model's own cap (triton/image_inputs.py MAX_IMAGES) bounds it."""

from __future__ import annotations

import argparse
import json

DEFAULT_MEDIA_MAX_BYTES = 20 << 20  # the llm model's limit on one image file (triton/image_inputs.py)
DEFAULT_MEDIA_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
MAX_IMAGES_PER_PROMPT = 16  # the llm model's cap (triton/image_inputs.py MAX_IMAGES)
MODALITIES = ("image",)


def limit_mm_per_prompt(text: str) -> dict[str, int]:
    """An argparse type: vLLM's `{"image": N}` JSON (N >= 0, at most the llm model's cap)."""
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError('a JSON object such as {"image": 4}')
    for modality, count in limits.items():
        if modality not in MODALITIES:
            raise argparse.ArgumentTypeError(f"unknown modality {modality!r}; pagedserve takes {list(MODALITIES)}")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_IMAGES_PER_PROMPT:
            raise argparse.ArgumentTypeError(f"{modality}: an integer in [0, {MAX_IMAGES_PER_PROMPT}] (the llm "
                                             f"model's cap), got {count!r}")
    return limits


def _positive(kind: type) -> object:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def add_media_arguments(parser: argparse.ArgumentParser, limit_flag: bool = True) -> None:
    """Register the media flags (the shim's and `serve`'s, the same names); `limit_flag` false leaves out
    --limit-mm-per-prompt (serve has the engine parameter's flag of that name)."""
    group = parser.add_argument_group("images (the OpenAI shim)")
    group.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                       help="http(s) image_url hosts the shim may fetch from (none by default: only data: URLs); "
                            "a name allows that host (and a loopback or private address only when listed as an "
                            "address or network, e.g. 127.0.0.1 or 10.0.0.0/8)")
    group.add_argument("--media-fetch-timeout", type=_positive(float), default=DEFAULT_MEDIA_FETCH_TIMEOUT_S,
                       metavar="SECONDS", help="seconds one image_url fetch may take")
    group.add_argument("--media-max-bytes", type=_positive(int), default=DEFAULT_MEDIA_MAX_BYTES, metavar="BYTES",
                       help="the largest image an image_url fetch may return")
    if limit_flag:
        group.add_argument("--limit-mm-per-prompt", type=limit_mm_per_prompt, default=None, metavar="JSON",
                           help=f'at most N images a request, as vLLM: \'{{"image": N}}\' (default: the llm '
                                f"model's limit_mm_per_prompt; most: {MAX_IMAGES_PER_PROMPT})")


def media_shim_flags(args: argparse.Namespace) -> list[str]:
    """The shim's media flags that `serve` was given other than their defaults."""
    flags = ["--allowed-media-domains", *args.allowed_media_domains] if args.allowed_media_domains else []
    if args.media_fetch_timeout != DEFAULT_MEDIA_FETCH_TIMEOUT_S:
        flags += ["--media-fetch-timeout", str(args.media_fetch_timeout)]
    if args.media_max_bytes != DEFAULT_MEDIA_MAX_BYTES:
        flags += ["--media-max-bytes", str(args.media_max_bytes)]
    limit = getattr(args, "limit_mm_per_prompt", None)  # serve's engine flag gives the JSON text
    if limit is not None:
        flags += ["--limit-mm-per-prompt", limit if isinstance(limit, str) else json.dumps(limit)]
    return flags


def image_limit(args: argparse.Namespace) -> int:
    """The images a request may carry under --limit-mm-per-prompt."""
    return (args.limit_mm_per_prompt or {}).get("image", MAX_IMAGES_PER_PROMPT)
