"""One real tritonserver for the whole session, on free loopback ports, serving the pagedserve model
repository (llm, preprocessing, postprocessing, ensemble) with a tiny random-weight Llama.

Use the `triton_server` fixture: it yields a `RunningTriton` (URLs, model path, metric reader).
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from pagedserve.client.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonServer,
    fetch_metrics,
    model_metric,
    prepare_model_repository,
)
from pagedserve.client.launcher import free_loopback_ports as free_ports

# Small, fixed engine settings: the prompt-length test relies on max_model_len.
TEST_ENGINE_PARAMS = {
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": "256",
    "num_blocks": "256",
    "max_num_seqs": "64",
    "max_num_batched_tokens": "1024",
}
READY_TIMEOUT_SECONDS = 300
REQUEST_TIMEOUT_SECONDS = 120
_TRITON_DTYPES = {np.object_: "BYTES", np.bool_: "BOOL", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64"}


def grpc_inputs(values: dict[str, object]) -> list[grpcclient.InferInput]:
    """tritonclient inputs from plain values: str/bytes -> BYTES[1], bool -> BOOL[1], list[str] -> BYTES[n],
    dict -> its JSON as BYTES[1], or a numpy array as is (int32, float32, uint64, bool, object)."""
    inputs = []
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            array = value
        elif isinstance(value, bool):
            array = np.array([value], dtype=np.bool_)
        elif isinstance(value, dict):
            array = np.array([json.dumps(value).encode()], dtype=np.object_)
        elif isinstance(value, (str, bytes)):
            array = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
        elif isinstance(value, list):
            array = np.array([v.encode() for v in value], dtype=np.object_)
        else:
            raise TypeError(f"no tensor form for {name}={value!r}")
        tensor = grpcclient.InferInput(name, list(array.shape), _TRITON_DTYPES[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class StreamResult:
    """Everything one gRPC streaming request got back: its responses in order, or the error that ended it."""

    responses: list[grpcclient.InferResult]
    error: Exception | None

    def texts(self, name: str = "text_output") -> list[str]:
        """The first element of `name` in every response, decoded."""
        return [r.as_numpy(name).reshape(-1)[0].decode() for r in self.responses if r.as_numpy(name) is not None]

    def finals(self) -> list[bool]:
        """The triton_final_response flag of every response."""
        return [r.get_response().parameters["triton_final_response"].bool_param for r in self.responses]


@dataclass
class RunningTriton:
    """A started tritonserver: `host:port` URLs as tritonclient takes them, and a metric reader."""

    http_url: str
    grpc_url: str
    metrics_url: str
    model_path: Path
    log_path: Path
    engine_params: dict[str, str]

    def metrics_text(self) -> str:
        """The Prometheus text of the metrics port."""
        return fetch_metrics(self.metrics_url)

    def metric(self, name: str, model: str = "llm") -> float:
        """The value of the sample `name` (e.g. "vllm:kv_cache_usage_perc") for `model`; 0.0 if absent."""
        return model_metric(self.metrics_text(), name, model)

    def post(self, path: str, body: dict | bytes) -> tuple[int, str]:
        """POST JSON (or raw bytes) to the HTTP endpoint; (status, body text), errors included."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def generate(self, model: str, body: dict) -> dict:
        """`v2/models/<model>/generate`; the JSON answer (an {"error": ...} object on failure)."""
        return json.loads(self.post(f"/v2/models/{model}/generate", body)[1])

    def generate_stream(self, model: str, body: dict) -> list[dict]:
        """`v2/models/<model>/generate_stream`: the JSON object of every SSE `data:` event."""
        _, text = self.post(f"/v2/models/{model}/generate_stream", body)
        return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]

    def open_stream(self, model: str, values: dict[str, object], request_id: str = ""
                    ) -> tuple[grpcclient.InferenceServerClient, queue.Queue]:
        """Send one request on a new gRPC stream; (client, queue of (result, error)). Close the client."""
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(model, grpc_inputs(values), request_id=request_id,
                                  enable_empty_final_response=True)
        return client, answers

    def grpc_stream(self, model: str, values: dict[str, object], request_id: str = "") -> StreamResult:
        """One request over a gRPC bidirectional stream, collected until its final response or error."""
        client, answers = self.open_stream(model, values, request_id)
        try:
            responses = []
            while True:
                result, error = answers.get(timeout=REQUEST_TIMEOUT_SECONDS)
                if error is not None:
                    return StreamResult(responses, error)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    if result.get_response().outputs:
                        responses.append(result)
                    return StreamResult(responses, None)
                responses.append(result)
        finally:
            client.stop_stream()
            client.close()




@pytest.fixture
def free_loopback_ports() -> list[int]:
    """Four distinct free ports on 127.0.0.1 (HTTP, gRPC, metrics, OpenAI)."""
    return free_ports(4)


@pytest.fixture(scope="session")
def triton_server(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """tritonserver with the whole pagedserve repository and the tiny Llama; stopped at session end."""
    work_dir = tmp_path_factory.mktemp("tritonserver")
    repository = prepare_model_repository(
        DEFAULT_MODEL_REPOSITORY, work_dir / "models", str(tiny_llama_path), TEST_ENGINE_PARAMS
    )
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = work_dir / "tritonserver.log"
    server = TritonServer(
        repository,
        work_dir=work_dir,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        log_file=log_path,
    )
    server.start()
    try:
        server.wait_ready(READY_TIMEOUT_SECONDS)
        yield RunningTriton(
            http_url=server.http_url,
            grpc_url=server.grpc_url,
            metrics_url=server.metrics_url,
            model_path=Path(tiny_llama_path),
            log_path=log_path,
            engine_params=dict(TEST_ENGINE_PARAMS),
        )
    finally:
        server.stop()
