"""The llm model's engine loop and response threads with a scripted engine and fake senders: each request's
responses in order, exactly one FINAL and always last, on every path (finish, engine error, a raising step,
cancellation, unload, shutdown), and the step's metrics before its final responses."""

from __future__ import annotations

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton.engine_loop import SHUTTING_DOWN
from pagedserve.backend.triton.lora import LoRAControl
from pagedserve.backend.triton.messages import Cancel, ControlRequest, Stop, Unloading
from pagedserve.backend.triton.protocols import FINAL
from tests.support.triton_glue import FakeEncoder, FakeMetrics, FakeSender, Glue, ScriptedEngine, in_flight

SHUT_DOWN = ("error", "ShuttingDownError", SHUTTING_DOWN)


def _streamed(*texts: str) -> list[tuple]:
    """The sends of a streamed request that finished normally: one token each, the last one FINAL."""
    return [(("output", [text]), FINAL if i == len(texts) - 1 else 0) for i, text in enumerate(texts)]


def test_each_request_gets_its_tokens_in_order_and_one_final_response_last():
    engine = ScriptedEngine()
    glue = Glue(engine)
    streamed, whole = FakeSender(), FakeSender()
    glue.submit(in_flight("a", streamed, max_tokens=3), in_flight("b", whole, max_tokens=2, stream=False))
    glue.run()
    assert streamed.sends == _streamed("t100", "t101", "t102")
    assert whole.sends == [(("output", ["t200t201"]), FINAL)]
    assert engine.calls == [("add", "a"), ("add", "b"), ("step", 1), ("step", 2), ("step", 3)]


def test_a_steps_metrics_go_out_after_its_tokens_and_before_its_final_responses():
    events: list = []
    glue = Glue(ScriptedEngine(), metrics=FakeMetrics(events))
    sender = FakeSender(events)
    glue.submit(in_flight("a", sender, max_tokens=2))
    glue.run()
    assert [event[:1] + event[2:] if event[0] == "send" else event for event in events] == [
        ("update", 0),  # idle, before the request came
        ("send", ("output", ["t100"]), 0),
        ("update", 1),  # step 1: a first token
        ("update", 0),  # step 2: a ended, counted before its final response leaves
        ("send", ("output", ["t101"]), FINAL),
        ("update", 0),  # idle again
    ]


def test_with_two_response_threads_the_other_threads_finals_wait_for_thread_0s_metrics():
    events: list = []
    glue = Glue(ScriptedEngine(), threads=2, metrics=FakeMetrics(events, update_seconds=0.1))
    first, second = FakeSender(events), FakeSender(events)
    glue.submit(in_flight("a", first, max_tokens=1, stream=False), in_flight("b", second, max_tokens=1))
    glue.run()
    kinds = [event[0] for event in events]
    # Thread 1 (b's) sends its final only once thread 0 has published the step's slow metrics.
    assert kinds[:2] == ["update", "update"] and kinds.count("send") == 2
    assert second.sends == [(("output", ["t200"]), FINAL)] and first.sends == [(("output", ["t100"]), FINAL)]


def test_an_engine_error_ends_only_the_failed_steps_requests_and_is_logged_and_counted():
    engine = ScriptedEngine()
    engine.fail_at = {2: {"a"}}
    glue = Glue(engine)
    doomed, bystander = FakeSender(), FakeSender()
    glue.submit(in_flight("a", doomed, max_tokens=5), in_flight("b", bystander, max_tokens=4))
    glue.run()
    assert doomed.sends == [(("output", ["t100"]), 0),
                            (("error", "RuntimeError", "RuntimeError: forward failed"), FINAL)]
    assert bystander.sends == _streamed("t200", "t201", "t202", "t203")
    assert glue.metrics.calls.count(("step_failure",)) == 1
    assert ("error", "pagedserve engine step failed (RuntimeError: forward failed); ended 1 request(s) with an "
            "error") in glue.log.lines


def test_a_step_that_raises_ends_its_running_requests_with_an_error_and_the_loop_serves_on():
    engine = ScriptedEngine()
    engine.raise_at = {2}
    glue = Glue(engine)
    a, b, later = FakeSender(), FakeSender(), FakeSender()
    engine.hooks[2] = lambda: glue.submit(in_flight("c", later, max_tokens=2))
    glue.submit(in_flight("a", a, max_tokens=5), in_flight("b", b, max_tokens=5, stream=False))
    glue.run()
    failed = ("error", "RuntimeError", "engine step failed: boom in step 2")
    assert a.sends == [(("output", ["t100"]), 0), (failed, FINAL)]
    assert b.sends == [(failed, FINAL)]
    assert later.sends == _streamed("t300", "t301")
    assert [call for call in engine.calls if call[0] == "abort"] == [("abort", "a"), ("abort", "b")]
    assert glue.metrics.calls.count(("step_failure",)) == 1
    assert ("error", "pagedserve engine step failed: RuntimeError('boom in step 2')") in glue.log.lines


def test_a_cancelled_request_is_aborted_in_the_engine_and_ends_cancelled_while_others_finish():
    engine = ScriptedEngine()
    glue = Glue(engine)
    cancelled, other = FakeSender(), FakeSender()
    engine.hooks[2] = lambda: glue.submit(Cancel("a"))
    glue.submit(in_flight("a", cancelled, max_tokens=5), in_flight("b", other, max_tokens=4))
    glue.run()
    assert cancelled.sends == [(("output", ["t100"]), 0), (("output", ["t101"]), 0), (("cancelled",), FINAL)]
    assert other.sends == _streamed("t200", "t201", "t202", "t203")
    assert engine.calls.index(("abort", "a")) == engine.calls.index(("step", 2)) + 1


def test_a_cancel_for_a_request_that_already_ended_changes_nothing():
    engine = ScriptedEngine()
    glue = Glue(engine)
    sender = FakeSender()
    engine.hooks[2] = lambda: glue.submit(Cancel("a"))
    glue.submit(in_flight("a", sender, max_tokens=1), in_flight("b", FakeSender(), max_tokens=3))
    glue.run()
    assert sender.sends == _streamed("t100")
    assert ("abort", "a") not in engine.calls


def test_shutdown_ends_running_and_queued_requests_with_shutting_down():
    engine = ScriptedEngine()
    glue = Glue(engine, stop_when_idle=False)
    a, b, queued = FakeSender(), FakeSender(), FakeSender()
    engine.hooks[3] = lambda: glue.submit(Stop(), in_flight("c", queued))
    glue.submit(in_flight("a", a, max_tokens=10), in_flight("b", b, max_tokens=10, stream=False))
    glue.run()
    assert a.sends == [(("output", ["t100"]), 0), (("output", ["t101"]), 0), (("output", ["t102"]), 0),
                       (SHUT_DOWN, FINAL)]
    assert b.sends == [(SHUT_DOWN, FINAL)]
    assert queued.sends == [(SHUT_DOWN, FINAL)]
    assert engine.calls[-2:] == [("abort", "a"), ("abort", "b")]


def test_the_unload_grace_ends_what_runs_and_refuses_what_comes_after():
    engine = ScriptedEngine()
    glue = Glue(engine, stop_when_idle=False)
    running, late = FakeSender(), FakeSender()
    engine.hooks[2] = lambda: glue.submit(Unloading())
    glue.submit(in_flight("a", running, max_tokens=10))
    engine.on_idle = lambda: glue.submit(in_flight("b", late), Stop())
    glue.run()
    assert running.sends == [(("output", ["t100"]), 0), (("output", ["t101"]), 0), (SHUT_DOWN, FINAL)]
    assert late.sends == [(SHUT_DOWN, FINAL)]
    assert ("add", "b") not in engine.calls


def test_a_request_the_engine_refuses_gets_its_error_as_its_only_response():
    engine = ScriptedEngine()
    engine.refuse["a"] = InvalidRequestError("max_tokens is too large", "max_tokens")
    glue = Glue(engine)
    refused, fine = FakeSender(), FakeSender()
    glue.submit(in_flight("a", refused), in_flight("b", fine, max_tokens=1))
    glue.run()
    assert refused.sends == [(("error", "InvalidRequestError", "max_tokens is too large"), FINAL)]
    assert fine.sends == _streamed("t100")


def test_a_response_that_cannot_be_built_ends_its_request_with_that_error():
    class BrokenEncoder(FakeEncoder):
        def tensors(self, request, output):
            if request.request_id == "a":
                raise ValueError("cannot encode")
            return super().tensors(request, output)

    glue = Glue(ScriptedEngine())
    glue.responders[0].encoder = BrokenEncoder()
    broken, fine = FakeSender(), FakeSender()
    glue.submit(in_flight("a", broken, max_tokens=3), in_flight("b", fine, max_tokens=2))
    glue.run()
    assert broken.sends == [(("error", "ValueError", "cannot encode"), FINAL)]
    assert fine.sends == _streamed("t200", "t201")
    assert ("error", "pagedserve response thread: ValueError('cannot encode')") in glue.log.lines


def test_a_request_waits_for_its_grammar_off_the_engine_while_others_run():
    engine = ScriptedEngine()
    glue = Glue(engine)
    structured, plain = FakeSender(), FakeSender()
    engine.hooks[2] = lambda: engine.structured.futures[0].set_result(("grammar", True))
    glue.submit(in_flight("a", structured, max_tokens=2, structured_outputs={"regex": "x+"}),
                in_flight("b", plain, max_tokens=3))
    glue.run()
    assert engine.calls[:4] == [("add", "b"), ("step", 1), ("step", 2), ("add", "a")]
    assert plain.sends == _streamed("t100", "t101", "t102")
    assert structured.sends == _streamed("t200", "t201")


def test_a_request_cancelled_while_its_grammar_compiles_never_reaches_the_engine():
    engine = ScriptedEngine()
    glue = Glue(engine)
    cancelled, plain = FakeSender(), FakeSender()

    def cancel_then_compile() -> None:
        glue.submit(Cancel("a"))
        engine.hooks[3] = lambda: engine.structured.futures[0].set_result(("grammar", True))

    engine.hooks[1] = cancel_then_compile
    glue.submit(in_flight("a", cancelled, structured_outputs={"regex": "x+"}), in_flight("b", plain, max_tokens=4))
    glue.run()
    assert cancelled.sends == [(("cancelled",), FINAL)]
    assert plain.sends == _streamed("t100", "t101", "t102", "t103")
    assert ("add", "a") not in engine.calls and ("abort", "a") not in engine.calls


def test_a_lora_control_request_is_answered_once_from_the_engine_thread():
    engine = ScriptedEngine()
    engine.loras["sql"] = "/adapters/sql"
    glue = Glue(engine, stop_when_idle=False)
    sender = FakeSender()
    glue.submit(ControlRequest(sender, LoRAControl("list")), Stop())
    glue.run()
    assert sender.sends == [(("control", {"message": "", "lora_adapters": {"sql": "/adapters/sql"}}), FINAL)]
