"""The engine loop with images: a request's images are processed on their own thread while the engine steps on
(it joins the engine when they are ready, holding nothing before), and a refusal from processing is its error
response; a cancelled request never reaches the engine."""

from __future__ import annotations

from concurrent.futures import Future

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.triton.messages import Cancel
from pagedserve.backend.triton.protocols import FINAL
from tests.support.triton_glue import FakeSender, Glue, ScriptedEngine, in_flight


class FakeImageProcessor:
    """process_async hands out futures the test completes; `seen` records each request's images."""

    def __init__(self) -> None:
        self.futures: list[Future] = []
        self.seen: list[object] = []

    def process_async(self, prompt: object, images: object, add_special_tokens: bool = True) -> Future:
        self.seen.append(images)
        self.futures.append(Future())
        return self.futures[-1]


def _with_images(request_id: str, sender: FakeSender, images: list[bytes], max_tokens: int = 2):
    request = in_flight(request_id, sender, max_tokens=max_tokens)
    request.inputs.images = images
    return request


def _streamed(*texts: str) -> list[tuple]:
    """The sends of a streamed request that finished normally: one token each, the last one FINAL."""
    return [(("output", [text]), FINAL if i == len(texts) - 1 else 0) for i, text in enumerate(texts)]


def test_a_request_waits_for_its_images_off_the_engine_while_others_run():
    engine = ScriptedEngine()
    engine.image_processor = FakeImageProcessor()
    glue = Glue(engine)
    pictured, plain = FakeSender(), FakeSender()
    engine.hooks[2] = lambda: engine.image_processor.futures[0].set_result("processed")
    glue.submit(_with_images("a", pictured, [b"png"]), in_flight("b", plain, max_tokens=3))
    glue.run()
    assert engine.image_processor.seen == [[b"png"]]
    assert engine.calls[:4] == [("add", "b"), ("step", 1), ("step", 2), ("add", "a")]
    assert engine.images["a"].result() == "processed"
    assert plain.sends == _streamed("t100", "t101", "t102")
    assert pictured.sends == _streamed("t200", "t201")


def test_a_refusal_from_image_processing_is_the_requests_error():
    engine = ScriptedEngine()
    engine.image_processor = FakeImageProcessor()
    glue = Glue(engine)
    pictured, plain = FakeSender(), FakeSender()
    refusal = InvalidRequestError("images[0] is not a readable image file", "images")
    engine.hooks[1] = lambda: engine.image_processor.futures[0].set_exception(refusal)
    glue.submit(_with_images("a", pictured, [b"junk"]), in_flight("b", plain, max_tokens=3))
    glue.run()
    assert len(pictured.sends) == 1 and pictured.sends[0][1] == FINAL
    assert "not a readable image" in str(pictured.sends[0][0])
    assert plain.sends == _streamed("t100", "t101", "t102")


def test_a_request_cancelled_while_its_images_are_processed_never_reaches_the_engine():
    engine = ScriptedEngine()
    engine.image_processor = FakeImageProcessor()
    glue = Glue(engine)
    cancelled, plain = FakeSender(), FakeSender()

    def cancel_then_finish() -> None:
        glue.submit(Cancel("a"))
        engine.hooks[3] = lambda: engine.image_processor.futures[0].set_result("processed")

    engine.hooks[1] = cancel_then_finish
    glue.submit(_with_images("a", cancelled, [b"png"]), in_flight("b", plain, max_tokens=4))
    glue.run()
    assert cancelled.sends == [(("cancelled",), FINAL)]
    assert ("add", "a") not in engine.calls
