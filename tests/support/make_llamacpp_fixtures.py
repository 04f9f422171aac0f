"""Make the committed GGUF fixtures of tests/fixtures/llamacpp/ with llama.cpp's own `llama-quantize`.

A tiny random Llama (one layer, hidden 256 so every row is whole 256-value super-blocks, the token table tied) is
written as an F32 GGUF by tests/support/tiny_gguf (as llama.cpp's converter lays it out: Q/K rows permuted), then
quantized by llama-quantize to each type of TYPES, llama.cpp choosing each tensor's type within the mix (Q4_K_M's
Q6_K rows, the tied table as the output). The files are llama.cpp's bytes: tests/engine/test_gguf_llamacpp.py
checks our unpacking against gguf-py's dequantize on them and serves them against transformers.

Made with the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (ggml 0.25.3, libllama 0.5.0), built by
bench/llamacpp_peer.quantize_binary. Run from the repository root:

    .venv/bin/python -m tests.support.make_llamacpp_fixtures [--llama-quantize PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "llamacpp"
TYPES = ("Q4_K_M", "Q6_K", "Q5_K_S", "Q3_K_M", "IQ4_XS")
# The tiny model: make_tiny_model's arguments (the tests rebuild its config and tokenizer from them).
MODEL = dict(arch="llama", seed=37, hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2,
             num_layers=1, tie_word_embeddings=True, random_norms=True)
LLAMA_CPP = "llama.cpp vendored in llama-cpp-python 0.3.36 (ggml 0.25.3)"


def fixture(kind: str) -> Path:
    return FIXTURES / f"tiny-llama.{kind}.gguf"


def make_hf_model(path: Path) -> Path:
    """The tiny model's Hugging Face folder (config, tokenizer, fp32 weights)."""
    from pagedserve.testing import make_tiny_model

    return make_tiny_model(path, **MODEL)


def _peer() -> ModuleType:
    """bench/llamacpp_peer.py loaded from its file: bench/ never goes on sys.path, where a module named like a package (HF kernels) would
    shadow Hugging Face's `kernels` package that transformers imports."""
    module = sys.modules.get("llamacpp_peer")
    if module is None:
        spec = importlib.util.spec_from_file_location("llamacpp_peer", ROOT / "bench" / "llamacpp_peer.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["llamacpp_peer"] = module
        spec.loader.exec_module(module)
    return module


def built_llama_quantize() -> Path | None:
    """The llama-quantize bench/llamacpp_peer has built already, or None (building it takes long: tests never do)."""
    binary = _peer().SERVER_BUILD / "bin" / "llama-quantize"
    return binary if binary.is_file() else None


def llama_quantize(binary: Path, source: Path, out: Path, kind: str) -> Path:
    """`source` quantized by llama.cpp to `kind` (one thread) at `out`."""
    proc = subprocess.run([str(binary), str(source), str(out), kind, "1"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize {kind} failed: {(proc.stderr or proc.stdout)[-800:]}")
    return out


def _llama_quantize(given: str | None) -> Path:
    if given:
        return Path(given)
    binary, why = _peer().quantize_binary()
    if binary is None:
        raise SystemExit(f"no llama-quantize: {why}")
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-quantize", help="the llama-quantize binary (default: bench/llamacpp_peer builds it)")
    args = parser.parse_args()
    binary = _llama_quantize(args.llama_quantize)
    from tests.support import tiny_gguf

    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_hf_model(Path(tmp) / "hf")
        source = tiny_gguf.write_blocks_gguf(folder, Path(tmp) / "tiny-llama.F32.gguf", lambda name: None)
        for kind in TYPES:
            llama_quantize(binary, source, fixture(kind), kind)
            print(f"{fixture(kind).relative_to(ROOT)}: {fixture(kind).stat().st_size} bytes")


if __name__ == "__main__":
    main()
