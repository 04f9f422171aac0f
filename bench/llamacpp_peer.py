"""llama.cpp beside pagedserve on the same GGUF file (issue 19's peer): the `llama-cpp-python` binding, built once
into its own cache venv, decoding one stream; and llama.cpp's own `llama-server --parallel N`, built once from
the binding's vendored source, serving N concurrent streams. Both greedy, `ignore_eos`, one thread each.

Used by bench/quantized.py (`--llama-cpp`); `python bench/llamacpp_peer.py` only builds them (and `llama-quantize`,
which makes the K-quant files the benchmark compares on: `python bench/llamacpp_peer.py Q4_K_M Q6_K`).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
PEERS = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")).expanduser() / "peers"
VENV = PEERS / "llama-cpp-venv"
SERVER_BUILD = PEERS / "llama-server-build"
# Serial builds: this bench runs on shared 2-core machines where a -j build starves every other process.
_BUILD_ENV = {"CMAKE_BUILD_PARALLEL_LEVEL": "1", "CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"}


def binding_python(venv: Path = VENV) -> tuple[Path | None, str]:
    """The python of a venv holding llama-cpp-python, built there on first use (~20 min); (None, why) on failure."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    print(f"building {PACKAGE} into {venv} (once)...", file=sys.stderr, flush=True)
    for step in ([sys.executable, "-m", "venv", str(venv)], [str(python), "-m", "pip", "install", "-q", PACKAGE]):
        proc = subprocess.run(step, capture_output=True, text=True, env={**os.environ, **_BUILD_ENV})
        if proc.returncode != 0:
            return None, f"`{' '.join(step)}` failed: {proc.stderr.strip()[-500:]}"
    return python, ""


def server_binary(build: Path = SERVER_BUILD) -> tuple[Path | None, str]:
    """llama.cpp's `llama-server`, built on first use from the vendored source of the same sdist."""
    return _vendored_tool("llama-server", build)


def quantize_binary(build: Path = SERVER_BUILD) -> tuple[Path | None, str]:
    """llama.cpp's `llama-quantize` (makes K-quant files from a GGUF), built like `llama-server`, sharing its
    build folder so the ggml and llama libraries are compiled once."""
    return _vendored_tool("llama-quantize", build)


def _vendored_tool(target: str, build: Path) -> tuple[Path | None, str]:
    """build/bin/<target>, built once (serially) from the sdist's vendored llama.cpp; (None, why) on failure."""
    binary = build / "bin" / target
    if binary.is_file():
        return binary, ""
    build.mkdir(parents=True, exist_ok=True)
    # One builder at a time per folder: another process asking meanwhile waits for it, then finds the binary.
    with open(build.parent / f".{build.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return (binary, "") if binary.is_file() else _build_tool(target, build, binary)


def _build_tool(target: str, build: Path, binary: Path) -> tuple[Path | None, str]:
    source, why = _vendored_source(build)
    if source is None:
        return None, why
    steps = [["cmake", "--build", str(build), "--target", target, "-j", "1"]]
    if not (build / "CMakeCache.txt").is_file():
        steps.insert(0, ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                         "-DLLAMA_BUILD_SERVER=ON"])
    print(f"building {target} into {build} (once)...", file=sys.stderr, flush=True)
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"`{' '.join(step)}` failed: {proc.stderr.strip()[-500:]}"
    return (binary, "") if binary.is_file() else (None, f"built, but no {binary}")


def _vendored_source(build: Path) -> tuple[Path | None, str]:
    """The llama.cpp source tree vendored in the sdist, downloaded and unpacked under `build` once."""
    sdist_dir = build / "sdist"
    found = next(sdist_dir.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if found is not None:
        return found, ""
    build.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                           "-d", str(sdist_dir), PACKAGE], capture_output=True, text=True)
    archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        return None, f"cannot download the {PACKAGE} sdist: {proc.stderr.strip()[-300:]}"
    with tarfile.open(archives[0]) as tar:
        tar.extractall(sdist_dir, filter="data")
    return next(sdist_dir.glob("llama_cpp_python-*/vendor/llama.cpp")), ""


def quantized_gguf(kind: str, source: Path | None = None) -> tuple[Path | None, str]:
    """The default model's GGUF requantized by llama.cpp's `llama-quantize --allow-requantize` to `kind` (Q4_K_M,
    Q6_K, ...), made once into <cache>/models/gguf/; (None, why) on failure. Tensors whose rows are not whole
    256-value super-blocks (SmolLM2's 576 columns) get llama-quantize's own fallback type (Q5_0, Q8_0, ...)."""
    from pagedserve.backend.model.default_model import GGUF_FILE, cache_root, find_gguf

    source = source or find_gguf()
    target = cache_root() / "models" / "gguf" / GGUF_FILE.replace(".Q4_1.", f".{kind}.")
    if target.is_file():
        return target, ""
    binary, why = quantize_binary()
    if binary is None:
        return None, why
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    proc = subprocess.run([str(binary), "--allow-requantize", str(source), str(partial), kind, "1"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"llama-quantize to {kind} failed: {(proc.stderr or proc.stdout).strip()[-500:]}"
    partial.replace(target)
    return target, ""


_BINDING_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from llama_cpp import Llama
    spec = json.load(open(sys.argv[1]))
    llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=1024,
                verbose=False, seed=0)
    def decode(prompt, n):
        out = 0
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out += 1
            if out == n:
                break
        return out
    decode(spec["prompts"][0][:8], 4)
    start = time.perf_counter()
    produced = sum(decode(p, spec["new_tokens"]) for p in spec["prompts"])
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - start, "output_tokens": produced}), flush=True)
    """
)


def binding_tok_s(python: Path, gguf: str, prompts: list[list[int]], new_tokens: int, threads: int,
                  work_dir: Path) -> float:
    """Output tokens/s of the binding decoding `prompts` one after another (its one stream)."""
    spec = work_dir / "llamacpp_spec.json"
    spec.write_text(json.dumps({"gguf": gguf, "prompts": prompts, "new_tokens": new_tokens, "threads": threads}))
    script = work_dir / "llamacpp_binding.py"
    script.write_text(_BINDING_SCRIPT)
    # A neutral working directory: nothing of the caller's on the peer's sys.path.
    proc = subprocess.run([str(python), str(script), str(spec)], capture_output=True, text=True, timeout=1800,
                          cwd=work_dir)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"llama-cpp-python failed: {proc.stderr.strip()[-800:]}")
    result = json.loads(line[len("RESULT "):])
    return result["output_tokens"] / result["seconds"]


def server_tok_s(binary: Path, gguf: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 port: int, cpu_time: bool = False) -> float:
    """Output tokens/s of `llama-server --parallel len(prompts)` with every prompt sent at once; with `cpu_time`,
    per second of the server's own CPU time (user + system) instead of wall time."""
    import httpx

    parallel = len(prompts)
    cmd = [str(binary), "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-tb",
           str(threads), "--parallel", str(parallel), "-c", str(parallel * 512), "--no-warmup"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _ready(url):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.5)

        def one(prompt: list[int]) -> int:
            body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                    "ignore_eos": True, "cache_prompt": False}
            answer = httpx.post(f"{url}/completion", json=body, timeout=1800).json()
            return int(answer["tokens_predicted"])

        one(prompts[0][:8])
        clock = (lambda: _cpu_seconds(server.pid)) if cpu_time else time.perf_counter
        start = clock()
        with ThreadPoolExecutor(parallel) as pool:
            produced = sum(pool.map(one, prompts))
        return produced / (clock() - start)
    finally:
        server.terminate()
        server.wait(30)


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ready(url: str) -> bool:
    """True once the server answers /health with 200 (it answers 503 while it loads the model)."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    for kind in sys.argv[1:]:  # e.g. Q4_K_M Q6_K: make those files (llama-quantize first: the shortest build)
        print(quantized_gguf(kind), flush=True)
    print(server_binary(), flush=True)
    print(binding_python(), flush=True)
