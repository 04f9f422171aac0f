"""Multi-LoRA through `pagedserve serve --lora ...` (tritonserver and the OpenAI shim, tiny Llama, PEFT adapters
made by the test): the `model` field selects an adapter as the engine run directly does, /v1/models lists them,
runtime load and unload, unknown and bad adapters, the llm model over gRPC, the ensemble, the metric."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.client.launcher import free_loopback_ports
from pagedserve.testing import make_lora_adapter, make_tiny_model
from tests.support.servers import RunningTriton

pytestmark = pytest.mark.slow

SEPARATOR = "_lora_"
PROMPT = "The capital of France is"
MAX_TOKENS = 8
START_DEADLINE_SECONDS = 300
ENGINE_FLAGS = ["--param", "device=cpu", "--param", "dtype=float32", "--param", "max_model_len=1024",
                "--param", "num_blocks=256", "--param", "max_num_seqs=16"]


@dataclass
class LoRAServer:
    """`pagedserve serve` with two adapters at start and a third one to load at run time."""

    triton: RunningTriton
    openai_url: str
    base: Path
    adapters: dict[str, Path]  # sql and chat served from the start; extra loaded by the tests

    @property
    def model(self) -> str:
        return self.base.name  # the shim's model id: serve passes the model folder


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRAServer]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "tiny", "llama")
    adapters = {name: make_lora_adapter(base, root / name, rank=8, seed=seed)
                for seed, name in enumerate(("sql", "chat", "extra"), start=1)}
    http_port, grpc_port, metrics_port, openai_port = free_loopback_ports(4)
    command = [sys.executable, "-m", "pagedserve.client.cli", "serve", "--model", str(base),
               f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
               f"--openai-port={openai_port}", "--lora", f"sql={adapters['sql']}", "--lora",
               f"chat={adapters['chat']}", "--max-loras", "2", "--max-cpu-loras", "3", "--enable-lora-runtime-updates",
               "--lora-separator", SEPARATOR, *ENGINE_FLAGS]
    work_dir = root / "tmp"
    work_dir.mkdir()
    launcher = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(work_dir)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_DEADLINE_SECONDS
        while not any("Ctrl-C stops it." in line for line in lines):
            assert launcher.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "serve did not come up:\n" + "".join(lines)
            time.sleep(0.5)
        triton = RunningTriton(http_url=f"127.0.0.1:{http_port}", grpc_url=f"127.0.0.1:{grpc_port}",
                               metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", model_path=base)
        yield LoRAServer(triton, f"http://127.0.0.1:{openai_port}", base, adapters)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        reader.join(timeout=30)


@pytest.fixture(scope="module")
def client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.openai_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine_texts(lora_server) -> dict[str | None, str]:
    """The greedy completion of PROMPT by the engine run directly: base, and under each adapter."""
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(lora_server.base), device="cpu", dtype="float32", num_blocks=64,
                                       enable_lora=True, max_loras=2, max_cpu_loras=3,
                                       lora_modules={k: str(v) for k, v in lora_server.adapters.items()})
    names = [None, "sql", "chat", "extra"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora_name=n) for n in names]
    outputs = engine.generate([PROMPT] * len(names), params)
    return {name: output.outputs[0].text for name, output in zip(names, outputs, strict=True)}


def _complete(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.model == model
    return answer.choices[0].text


def test_the_model_field_selects_an_adapter_as_the_engine_run_directly_does(client, lora_server, engine_texts):
    assert len(set(engine_texts.values())) == 4, engine_texts  # every adapter changes the output
    assert _complete(client, lora_server.model) == engine_texts[None]
    for name in ("sql", "chat"):
        assert _complete(client, name) == engine_texts[name]
        assert _complete(client, f"{lora_server.model}{SEPARATOR}{name}") == engine_texts[name]
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "chat" and chat.choices[0].message.content is not None


def test_models_lists_the_base_and_each_adapter_with_its_parent(client, lora_server):
    cards = {card.id: card for card in client.models.list()}
    base = lora_server.model
    assert list(cards) == [base, f"{base}{SEPARATOR}sql", f"{base}{SEPARATOR}chat"]
    for name in ("sql", "chat"):
        card = cards[f"{base}{SEPARATOR}{name}"]
        assert (card.parent, card.root) == (base, str(lora_server.adapters[name]))
    assert cards[base].parent is None
    assert client.models.retrieve("sql").parent == base


def test_an_unknown_adapter_is_404_naming_it_on_the_shim_and_refused_by_field_on_grpc(client, lora_server):
    with pytest.raises(openai.NotFoundError) as missing:
        _complete(client, "no-such-adapter")
    assert missing.value.body["code"] == "model_not_found" and "no-such-adapter" in missing.value.body["message"]
    result = lora_server.triton.grpc_stream("llm", {"text_input": PROMPT,
                                                    "sampling_parameters": {"lora_name": "no-such-adapter"}})
    assert result.error is not None and "no-such-adapter" in str(result.error)
    assert "field=lora_name" in str(result.error)


def test_the_llm_model_over_grpc_and_the_ensemble_take_lora_name(lora_server, engine_texts):
    sampling = {"lora_name": "sql", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    result = lora_server.triton.grpc_stream("llm", {"text_input": PROMPT, "sampling_parameters": sampling,
                                                    "exclude_input_in_output": True})
    assert result.error is None, result.error
    assert result.texts()[-1] == engine_texts["sql"]
    del sampling["ignore_eos"]  # not an input of the ensemble
    llm = lora_server.triton.grpc_stream("llm", {"text_input": PROMPT, "sampling_parameters": sampling,
                                                 "exclude_input_in_output": True})
    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "lora_name": "sql",
            "exclude_input_in_output": True}
    assert lora_server.triton.generate("ensemble", body)["text_output"] == llm.texts()[-1]


def _post(lora_server: LoRAServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{lora_server.openai_url}{path}", json=body, timeout=60)


def test_runtime_load_and_unload_and_an_adapter_in_use_is_not_unloaded(client, lora_server, engine_texts):
    load = {"lora_name": "extra", "lora_path": str(lora_server.adapters["extra"])}
    reply = _post(lora_server, "/v1/load_lora_adapter", load)
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'extra' added successfully."
    assert _post(lora_server, "/v1/load_lora_adapter", load).status_code == 400  # already loaded
    assert f"{lora_server.model}{SEPARATOR}extra" in [card.id for card in client.models.list()]
    assert _complete(client, "extra") == engine_texts["extra"]
    long_request = {"model": "extra", "prompt": PROMPT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{lora_server.openai_url}/v1/completions", json=long_request, timeout=60) as stream:
        lines = stream.iter_lines()  # held: a dropped iterator closes the stream, which cancels the request
        assert next(lines).startswith("data: ")
        refused = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "extra"})
        assert refused.status_code == 400 and "in use" in refused.json()["error"]["message"], refused.text
        info = _lora_info(lora_server)
        assert "extra" in info["running_lora_adapters"].split(",") and info["max_lora"] == "2"
    deadline = time.monotonic() + 30
    while (reply := _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "extra"})).status_code != 200:
        assert time.monotonic() < deadline, reply.text  # the cancelled stream's request leaves the engine
        time.sleep(0.2)
    assert reply.text == "Success: LoRA adapter 'extra' removed successfully."
    with pytest.raises(openai.NotFoundError):
        _complete(client, "extra")
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404


def _lora_info(lora_server: LoRAServer) -> dict[str, str]:
    """The labels of the llm model's current vllm:lora_requests_info sample: as in vLLM, the newest (its value
    is the time its labels became current)."""
    samples = re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", lora_server.triton.metrics_text(),
                         re.MULTILINE)
    assert sum(float(value) > 0 for _, value in samples) == 1, samples  # the older label sets read 0
    labels, _ = max(samples, key=lambda sample: float(sample[1]))
    return dict(re.findall(r'(\w+)="([^"]*)"', labels))


def test_a_bad_adapter_at_load_is_a_clear_error_and_the_server_keeps_serving(client, lora_server, tmp_path,
                                                                             engine_texts):
    missing = tmp_path / "missing"
    reply = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(missing)})
    assert reply.status_code == 404, reply.text  # vLLM's NotFoundError for a missing adapter
    assert "broken" in reply.json()["error"]["message"] and str(missing) in reply.json()["error"]["message"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    reply = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "corrupt", "lora_path": str(corrupt)})
    assert reply.status_code == 400 and "corrupt" in reply.json()["error"]["message"], reply.text
    assert "broken" not in [card.id for card in client.models.list()]
    assert _complete(client, "sql") == engine_texts["sql"]
