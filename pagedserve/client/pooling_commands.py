"""`pagedserve embed` (each text's embedding, one JSON line each) and `pagedserve rerank` (documents ranked
against a query by a cross-encoder, best first). Both send the `llm` model's embedding_request over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pagedserve.client.triton_client import TritonLLMClient, TritonRequestError, TritonUnavailableError

MULTI_COMMAND = True
DEFAULT_TRITON_URL = "localhost:8001"


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """`embed TEXT...` [--dimensions N] [--no-normalize]; `rerank QUERY DOCUMENT...` [--top-n N]."""
    if name == "embed":
        parser.add_argument("texts", nargs="+", help="texts to embed (one JSON line each on stdout)")
        parser.add_argument("--dimensions", type=int, default=None, help="a Matryoshka model's leading dimensions")
        parser.add_argument("--no-normalize", action="store_true", help="the raw pooled vector, not L2-normalised")
    else:
        parser.add_argument("query", help="the query the documents are ranked against")
        parser.add_argument("documents", nargs="+", help="the documents to rank")
        parser.add_argument("--top-n", type=int, default=None, help="print only the best N")
    parser.add_argument("--url", default=DEFAULT_TRITON_URL, help="tritonserver gRPC address HOST:PORT")


async def _pool_all(url: str, requests: list[dict]) -> list[list[float]]:
    client = TritonLLMClient(url)
    try:
        answers = await asyncio.gather(*(client.pool(r, f"cli-{i}") for i, r in enumerate(requests)))
    finally:
        await client.close()
    return [vector for vector, _ in answers]


def _requests(args: argparse.Namespace) -> list[dict]:
    if args.command == "embed":
        params: dict = {"task": "embed"}
        if args.dimensions is not None:
            params["dimensions"] = args.dimensions
        if args.no_normalize:
            params["normalize"] = False
        return [{"input": text, "pooling_params": params} for text in args.texts]
    return [{"input": args.query, "text_pair": doc, "pooling_params": {"task": "score"}} for doc in args.documents]


def run(args: argparse.Namespace) -> int:
    """Print the embeddings (JSON lines) or the ranking ("score<TAB>index<TAB>document" lines)."""
    if args.command == "rerank" and args.top_n is not None and args.top_n < 1:
        print("error: --top-n must be >= 1", file=sys.stderr)
        return 2
    try:
        vectors = asyncio.run(_pool_all(args.url, _requests(args)))
    except (TritonRequestError, TritonUnavailableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.command == "embed":
        for text, vector in zip(args.texts, vectors, strict=True):
            print(json.dumps({"text": text, "embedding": vector}, ensure_ascii=False))
        return 0
    scores = [v[0] for v in vectors]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: args.top_n]
    for i in order:
        print(f"{scores[i]:.6f}\t{i}\t{args.documents[i]}")
    return 0
