"""An exception injected into one engine step (small_pool_server's test model fails the forward of a step that
schedules a request carrying the fault marker, tests/support/faults.py): the requests of that step end with an
error, the engine serves everything else, and the failure is logged and counted in
pagedserve:engine_step_failures_total."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.servers import RunningTriton
from tests.support.streams import StreamResult

pytestmark = pytest.mark.slow

FAILURES = "pagedserve:engine_step_failures_total"
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _stream(server: RunningTriton, prompt: str) -> StreamResult:
    return server.grpc_stream("llm", {"text_input": prompt, "stream": True, "sampling_parameters": GREEDY,
                                      "exclude_input_in_output": True})


def test_a_failed_step_ends_its_request_with_an_error_and_is_logged_and_counted(small_pool_server,
                                                                                 fault_marker):
    small_pool_server.wait_idle()
    failures_before = small_pool_server.metric(FAILURES)
    doomed = _stream(small_pool_server, f"Doomed {fault_marker} request")
    assert doomed.responses == [] and "injected fault" in str(doomed.error)
    status, text = small_pool_server.post("/v2/models/llm/generate", {"text_input": f"{fault_marker} again"})
    assert status >= 400 and "injected fault" in text
    small_pool_server.wait_idle()
    assert small_pool_server.metric(FAILURES) == failures_before + 2
    assert "pagedserve engine step failed" in small_pool_server.log_path.read_text(errors="replace")
    after = _stream(small_pool_server, "A request after the fault")
    assert after.error is None and len(after.responses) == GREEDY["max_tokens"]


def test_requests_around_a_failing_step_finish_or_share_its_error_and_the_engine_serves_on(small_pool_server,
                                                                                          fault_marker):
    prompts = [f"Bystander {i} keeps on going" for i in range(12)]
    solo = {p: "".join(_stream(small_pool_server, p).texts()) for p in prompts}
    with ThreadPoolExecutor(max_workers=13) as pool:
        doomed = pool.submit(_stream, small_pool_server, f"Bystanders meet {fault_marker}")
        bystanders = dict(zip(prompts, pool.map(lambda p: _stream(small_pool_server, p), prompts), strict=True))
    assert "injected fault" in str(doomed.result().error)
    for prompt, result in bystanders.items():
        if result.error is None:
            assert "".join(result.texts()) == solo[prompt]  # untouched by the failure
        else:
            assert "injected fault" in str(result.error)  # scheduled in the failing step itself
    small_pool_server.wait_idle()
    again = {p: "".join(_stream(small_pool_server, p).texts()) for p in prompts[:3]}
    assert again == {p: solo[p] for p in prompts[:3]}


def test_a_failed_step_is_a_500_server_error_in_the_openai_shim(shim_url, small_pool_server, fault_marker):
    for stream in (False, True):
        reply = httpx.post(f"{shim_url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": f"Shim meets {fault_marker}", "max_tokens": 4, "stream": stream})
        # It fails before the first token, so a stream answers with the status too. A server fault, not the
        # client's: OpenAI clients may retry a 500, never a 400.
        assert reply.status_code == 500, reply.text
        error = reply.json()["error"]
        assert error["type"] == "server_error" and "injected fault" in error["message"]
    small_pool_server.wait_idle()
