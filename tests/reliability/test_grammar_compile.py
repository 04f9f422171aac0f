"""A structured-output grammar compiles off the engine thread: while one compiles (small_pool_server's test
model compiles a spec holding the fault marker slowly, standing in for a large schema on a real vocabulary),
other requests start and finish; the waiting request then runs, or is cancelled or refused cleanly, and nothing
is left allocated."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.faults import SLOW_COMPILE_SECONDS
from tests.support.servers import RunningTriton
from tests.support.streams import GrpcStream

pytestmark = pytest.mark.slow

FAST = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _slow_spec(marker: str, choices: list[str]) -> dict:
    # The marker is only in the spec's JSON (an unused $comment), so the output is one of `choices`.
    return {"max_tokens": 8, "structured_outputs": {"json": {"$comment": marker, "enum": choices}}}


def _answers(stream: GrpcStream, ids: set[str]) -> dict[str, list]:
    """Every answer of the requests in `ids` until each has its final one, by request id."""
    got: dict[str, list] = {rid: [] for rid in ids}
    open_ids = set(ids)
    while open_ids:
        answer = stream.next()
        rid = answer.result.get_response().id if answer.result is not None else next(iter(open_ids))
        got[rid].append(answer)
        if answer.final:
            open_ids.discard(rid)
    return got


def test_a_request_compiling_its_grammar_holds_no_other_request_back(small_pool_server: RunningTriton,
                                                                     fault_marker: str):
    small_pool_server.wait_idle()
    with GrpcStream(small_pool_server.grpc_url) as stream:
        stream.send("llm", {"text_input": "Pick one", "sampling_parameters": _slow_spec(fault_marker, ["x", "y"]),
                            "exclude_input_in_output": True}, request_id="slow")
        stream.send("llm", {"text_input": "Meanwhile", "sampling_parameters": FAST, "stream": True,
                            "exclude_input_in_output": True}, request_id="fast")
        got = _answers(stream, {"slow", "fast"})
    assert all(a.error is None for a in got["slow"] + got["fast"])
    assert len([a for a in got["fast"] if a.result.as_numpy("text_output") is not None]) == FAST["max_tokens"]
    # The fast request ended before the compiling one answered at all.
    assert got["fast"][-1].arrived < got["slow"][0].arrived
    text = got["slow"][-1].result.as_numpy("text_output").reshape(-1)[0].decode()
    assert json.loads(text) in ("x", "y")
    small_pool_server.wait_idle()


def test_a_bad_grammar_found_on_the_grammar_thread_is_refused_naming_the_field(small_pool_server, fault_marker):
    spec = {"structured_outputs": {"regex": f"{fault_marker}(unclosed"}}
    result = small_pool_server.grpc_stream("llm", {"text_input": "Hi", "sampling_parameters": spec})
    assert result.responses == [] and "structured_outputs.regex cannot be compiled" in str(result.error)
    assert "kind=invalid_argument" in str(result.error)
    small_pool_server.wait_idle()


def test_cancelling_a_request_while_its_grammar_compiles_ends_it_and_nothing_runs(small_pool_server,
                                                                                  fault_marker):
    small_pool_server.wait_idle()
    prompt_tokens = small_pool_server.metric("vllm:prompt_tokens_total")
    stream = GrpcStream(small_pool_server.grpc_url)
    stream.send("llm", {"text_input": "Cancel me", "sampling_parameters": _slow_spec(fault_marker, ["p", "q"]),
                        "stream": True}, request_id="doomed")
    time.sleep(0.5)  # the cancel watcher has the request
    stream.close(cancel=True)
    time.sleep(SLOW_COMPILE_SECONDS + 1.0)  # past the compile: a request not withdrawn would run now
    small_pool_server.wait_idle()
    assert small_pool_server.metric("vllm:prompt_tokens_total") == prompt_tokens
    after = small_pool_server.grpc_stream("llm", {"text_input": "After", "sampling_parameters": FAST})
    assert after.error is None and len(after.responses) == 1
