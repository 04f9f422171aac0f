"""Speculative decoding through tritonserver: a server with n-gram speculation streams, for greedy requests,
the same text as the session's plain server, and the vLLM spec-decode counters move (the accepted count per
draft position too)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest

from tests.support.servers import CPU_FP32, RunningTriton, triton_running

pytestmark = pytest.mark.slow

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repeated ids, so the n-gram lookup finds matches and drafts are proposed.
PROMPTS = [[5, 6, 7, 8] * 6, [10, 11, 12] * 5, [3, 9] * 7 + [4]]
GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def speculative_server(tiny_llama_path, tmp_path_factory) -> Iterator[RunningTriton]:
    params = {**CPU_FP32, "max_model_len": "256", "speculative_config": json.dumps(SPECULATIVE)}
    with triton_running(tiny_llama_path, tmp_path_factory.mktemp("speculative"), params, llm_only=True) as running:
        yield running


def _streamed_text(server: RunningTriton, ids: list[int]) -> str:
    result = server.grpc_stream("llm", {"input_ids": np.array(ids, dtype=np.int32), "stream": True,
                                        "sampling_parameters": GREEDY, "exclude_input_in_output": True})
    assert result.error is None, result.error
    return "".join(result.texts())


def test_speculative_streams_equal_the_plain_servers_and_the_counters_move(speculative_server, triton_server):
    drafts = speculative_server.metric("vllm:spec_decode_num_draft_tokens_total")
    for ids in PROMPTS:
        assert _streamed_text(speculative_server, ids) == _streamed_text(triton_server, ids)
    assert speculative_server.metric("vllm:spec_decode_num_drafts_total") > 0
    assert speculative_server.metric("vllm:spec_decode_num_draft_tokens_total") > drafts
    assert speculative_server.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
    assert triton_server.metric("vllm:spec_decode_num_drafts_total") == 0
    speculative_server.wait_idle()
    text = speculative_server.metrics_text()
    per_pos = {int(pos): float(value) for pos, value in re.findall(
        r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\}\s+(\S+)$', text, re.M)}
    assert sorted(per_pos) == list(range(SPECULATIVE["num_speculative_tokens"]))
    assert sum(per_pos.values()) == speculative_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and per_pos[0] > 0
