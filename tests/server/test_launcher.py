"""`pagedserve serve`: the generated repository and backend layout, and (slow) the launcher serving the
default SmolLM2 model end to end, then stopping with no process left behind."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pagedserve.backend.model.default_model import MODEL_NAME, ensure_default_model, find_gguf
from pagedserve.client import launcher as launcher_module
from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    OPENAI_MODULE,
    TritonInstall,
    TritonServer,
    add_arguments,
    fill_parameters,
    find_tritonserver,
    layout_backend_dir,
    prepare_model_repository,
    served_model,
)
from tests.support.servers import RunningTriton

# Everything up to the SIGTERM must happen within this, well inside pytest's 600 s timeout (which leaves
# room for the shutdown), so a server that never comes up fails here, with the launcher's output.
SERVE_DEADLINE_SECONDS = 240
PROMPT = "The capital of France is"
ANSWER_TOKENS = 8
CONFIG = '''backend: "python"
parameters { key: "model" value: { string_value: "" } }
parameters { key: "max_model_len" value: { string_value: "2048" } }
'''


def test_fill_parameters_sets_the_named_string_values_with_quotes_escaped():
    text = fill_parameters(CONFIG, {"model": '/models/my "best" model', "max_model_len": "4096"})
    assert 'key: "model" value: { string_value: "/models/my \\"best\\" model" }' in text
    assert 'key: "max_model_len" value: { string_value: "4096" }' in text


def test_fill_parameters_strict_refuses_a_parameter_the_config_lacks():
    with pytest.raises(ValueError, match="max_model_length"):
        fill_parameters(CONFIG, {"max_model_length": "4096"}, strict=True)


def test_prepare_model_repository_fills_the_model_everywhere_and_leaves_the_source_alone(tmp_path):
    source_llm = (DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    target = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "repo", "/m/tiny", {"max_num_seqs": "8"})
    assert sorted(p.name for p in target.iterdir()) == ["ensemble", "llm", "postprocessing", "preprocessing"]
    llm = (target / "llm" / "config.pbtxt").read_text()
    assert 'key: "model" value: { string_value: "/m/tiny" }' in llm
    assert 'key: "max_num_seqs" value: { string_value: "8" }' in llm
    for step in ("preprocessing", "postprocessing"):
        assert 'key: "tokenizer" value: { string_value: "/m/tiny" }' in (target / step / "config.pbtxt").read_text()
    assert (DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text() == source_llm


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_serve_without_model_serves_the_default_gguf_as_stored_and_the_folder_one_flag_away(tmp_path, monkeypatch):
    forms = []
    monkeypatch.setattr(launcher_module, "default_model_path",
                        lambda form: forms.append(form) or str(tmp_path / f"default-{form}"))
    naming = ["--model-name", MODEL_NAME]  # the model's name on /v1/models whichever form serves it
    assert served_model(_serve_args()) == (str(tmp_path / "default-gguf"), naming)
    assert served_model(_serve_args("--default-model-form", "folder")) == (str(tmp_path / "default-folder"), naming)
    assert forms == ["gguf", "folder"]
    assert served_model(_serve_args("--model", str(tmp_path / "m"))) == (str(tmp_path / "m"), [])
    with pytest.raises(SystemExit, match="only without --model"):
        served_model(_serve_args("--model", str(tmp_path / "m"), "--default-model-form", "gguf"))
    with pytest.raises(SystemExit):
        _serve_args("--default-model-form", "safetensors")


def test_backend_layout_uses_the_stub_built_for_this_python(tmp_path):
    install = find_tritonserver()
    backends = layout_backend_dir(install, tmp_path)
    if install.python_backend is None:
        assert backends is None  # a system tritonserver brings its own backends
        return
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = backends / "python" / "triton_python_backend_stub"
    assert stub.read_bytes() == (install.stub_dir / version / stub.name).read_bytes()
    assert (backends / "python" / "libtriton_python.so").exists()


def test_backend_layout_refuses_a_python_without_a_stub(tmp_path):
    empty_stubs = tmp_path / "stubs"
    empty_stubs.mkdir()
    install = TritonInstall(binary=Path("tritonserver"), python_backend=tmp_path, stub_dir=empty_stubs)
    with pytest.raises(RuntimeError, match="no triton_python_backend_stub for Python"):
        layout_backend_dir(install, tmp_path / "work")


@pytest.mark.slow
def test_an_engine_that_cannot_start_stops_the_server_with_the_reason(tmp_path, free_loopback_ports):
    repository = prepare_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "repo", str(tmp_path / "no-model"))
    for name in ("ensemble", "preprocessing", "postprocessing"):
        shutil.rmtree(repository / name)
    http_port, grpc_port, metrics_port, _ = free_loopback_ports
    server = TritonServer(repository, work_dir=tmp_path, http_port=http_port, grpc_port=grpc_port,
                          metrics_port=metrics_port, log_file=tmp_path / "tritonserver.log")
    with server, pytest.raises(RuntimeError, match="exited before it was ready") as failure:
        server.wait_ready(300)
    assert "the pagedserve engine failed to start" in str(failure.value)
    assert "no-model" in str(failure.value)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.slow
def test_serve_answers_with_the_default_model_and_sigterm_leaves_no_process(tmp_path, free_loopback_ports,
                                                                            hf_reference):
    from transformers import AutoTokenizer

    http_port, grpc_port, metrics_port, openai_port = free_loopback_ports
    # The launcher serves the default model's GGUF file as stored when given no --model; its float32 folder is
    # the reference's.
    model_path = Path(ensure_default_model())
    running = RunningTriton(http_url=f"127.0.0.1:{http_port}", grpc_url=f"127.0.0.1:{grpc_port}",
                            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", model_path=model_path)
    work_dir = tmp_path / "tmp"
    work_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(work_dir)}  # the launcher's generated files land here
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.client.cli", "serve", f"--http-port={http_port}",
         f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", f"--openai-port={openai_port}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    # Read the launcher's output as it comes: it prints the URLs once the shim answers, which can be after
    # the test's own readiness polls succeed.
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + SERVE_DEADLINE_SECONDS
        while _get(f"http://{running.http_url}/v2/health/ready") != 200:
            assert launcher.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "the server did not become ready:\n" + "".join(lines)
            time.sleep(1)
        answer = running.generate("llm", {
            "text_input": PROMPT, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True,
            "exclude_input_in_output": True, "return_logprobs": True, "logprobs": 0,
        })
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        expected, _ = hf_reference.greedy(model_path, tokenizer(PROMPT).input_ids, ANSWER_TOKENS)
        # Greedy in fp32 (the default model's dtype): exactly transformers' tokens and their text.
        assert [entry["token_id"] for entry in json.loads(answer["logprobs"])] == expected, answer
        assert answer["text_output"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert "Paris" in answer["text_output"]
        if importlib.util.find_spec(OPENAI_MODULE) is not None:
            while _get(f"http://127.0.0.1:{openai_port}/v1/models") != 200:
                assert time.monotonic() < deadline, "the OpenAI shim did not come up:\n" + "".join(lines)
                time.sleep(1)
            models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{openai_port}/v1/models").read())
            assert [card["id"] for card in models["data"]] == [MODEL_NAME]  # the model's name, not the file's
        while not any("Ctrl-C stops it." in line for line in lines):
            assert time.monotonic() < deadline, "the launcher did not print its URLs:\n" + "".join(lines)
            time.sleep(0.2)
        assert _processes_mentioning(str(work_dir)), "tritonserver should run from the generated folder"
        # A long request still running at shutdown must not keep the launcher (or any process) alive.
        stream = running.open_stream("llm", {"text_input": "Tell me a very long story.", "stream": True,
                                             "sampling_parameters": {"max_tokens": 1900, "ignore_eos": True}})
        assert stream.next(timeout=60).error is None
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        reader.join(timeout=30)
    output = "".join(lines)
    errors = []
    while stream.waiting():
        errors.append(stream.next().error)
    stream.close()
    # Triton waits up to its exit timeout for in-flight requests, then exits: the stream ends in an error.
    assert errors and errors[-1] is not None
    assert launcher.returncode == 0, output
    assert f"http://127.0.0.1:{http_port}" in output
    assert f"pagedserve is serving {find_gguf().resolve()}\n" in output
    assert _get(f"http://127.0.0.1:{http_port}/v2/health/live") == 0
    assert _get(f"http://127.0.0.1:{openai_port}/v1/models") == 0
    assert _processes_mentioning(str(work_dir)) == []


def test_the_ready_url_the_launcher_sets_is_the_one_the_llm_model_reads():
    from pagedserve.backend.triton.settings import HEALTH_URL_ENV
    from pagedserve.client.launcher import TRITON_READY_URL_ENV

    assert TRITON_READY_URL_ENV == HEALTH_URL_ENV
