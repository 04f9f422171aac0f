"""A non-Llama family end to end through tritonserver: a tiny Qwen3 streams, over gRPC, deltas that concatenate
to its non-streamed text, which is the in-process engine's greedy text for the same prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.testing import make_tiny_model
from tests.support.engines import cpu_engine
from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
PROMPT = "Café, naïve, 日本語 and 🙂:"


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-server"), "qwen3", seed=21, random_norms=True)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "num_blocks": "64"}
    with triton_running(qwen3_path, tmp_path_factory.mktemp("qwen3-server"), params, llm_only=True) as running:
        yield running


def test_qwen3_streamed_deltas_concatenate_to_the_non_streamed_text_of_the_engine(qwen3_server, qwen3_path):
    request = {"text_input": PROMPT, "sampling_parameters": GREEDY, "exclude_input_in_output": True}
    streamed = qwen3_server.grpc_stream("llm", {**request, "stream": True})
    whole = qwen3_server.grpc_stream("llm", request)
    assert streamed.error is None and whole.error is None
    assert len(streamed.responses) == GREEDY["max_tokens"] and len(whole.responses) == 1
    assert "".join(streamed.texts()) == whole.texts()[0]
    expected = cpu_engine(qwen3_path, num_blocks=16).generate(PROMPT, SamplingParams(**GREEDY))[0]
    assert whole.texts()[0] == expected.outputs[0].text
    qwen3_server.wait_idle()
