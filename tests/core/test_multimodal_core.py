"""The core's image bookkeeping: block hashes that name the images a block holds, the encoder budget that cuts a
chunk before an image that does not fit, and the encoder cache's holds and evictions."""

from __future__ import annotations

from pagedserve.backend.core.block_manager import BlockManager
from pagedserve.backend.core.config import CacheConfig, SchedulerConfig
from pagedserve.backend.core.multimodal import EncoderCache, ImageInput, StepEncoderCache, block_images_key
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.scheduler import Scheduler

IMG = 9  # the placeholder token


def _prompt(offsets: list[int], length: int, total: int) -> list[int]:
    ids = [1] * total
    for offset in offsets:
        ids[offset : offset + length] = [IMG] * length
    return ids


def _request(rid: str, hashes: list[str], offsets: list[int], length: int = 8, total: int = 32) -> Request:
    images = tuple(ImageInput(h, o, length, None) for h, o in zip(hashes, offsets, strict=True))
    return Request(rid, _prompt(offsets, length, total), mm_inputs=images)


def test_block_hash_names_the_images_of_its_placeholders():
    bm = BlockManager(16, block_size=4)
    a, b, same = _request("a", ["x"], [6]), _request("b", ["y"], [6]), _request("c", ["x"], [6])
    for r in (a, b, same):
        bm._update_block_hashes(r, 8)
    assert a.block_hashes[0] == b.block_hashes[0]  # text only: shared
    assert a.block_hashes[1] != b.block_hashes[1]  # same placeholder tokens, other image
    assert a.block_hashes == same.block_hashes
    assert block_images_key(a.mm_inputs, 0, 4) is None and block_images_key(a.mm_inputs, 12, 16) == "images:x"


def test_encoder_budget_cuts_the_chunk_before_an_image_that_does_not_fit():
    cache = StepEncoderCache(capacity=64, budget=10)
    images = (ImageInput("x", 4, 8, None), ImageInput("y", 14, 8, None))
    assert cache.plan(images, 0, 30) == 14  # x fits (and is the step's first image), y does not
    cache.commit("r", images, 0)
    assert cache.take_step()[0] == [images[0]]
    cache.start_step()
    assert cache.plan(images, 14, 16) == 16  # a new step: y fits its budget
    cache.commit("r", images, 14)
    assert cache.take_step()[0] == [images[1]]


def test_a_steps_first_image_runs_past_the_budget_and_the_next_waits():
    cache = StepEncoderCache(capacity=64, budget=4)
    images = (ImageInput("x", 0, 8, None), ImageInput("y", 8, 8, None))
    assert cache.plan(images, 0, 16) == 8
    cache.commit("r", images, 0)
    assert cache.plan((ImageInput("z", 2, 8, None),), 0, 10) == 2  # the budget is spent this step
    assert cache.plan((ImageInput("x", 0, 8, None),), 0, 10) == 10  # a cached image takes no budget


def test_released_entries_stay_until_evicted_oldest_first():
    cache = EncoderCache(capacity=16)
    for name in ("x", "y"):
        cache.add("r", ImageInput(name, 0, 8, None))
    assert [i.content_hash for i in cache.take_step()[0]] == ["x", "y"]
    cache.release("r")
    assert "x" in cache and "y" in cache
    cache.hold("s", "y")  # a repeat of y: held again, so x is the one to go
    cache.add("s", ImageInput("z", 0, 8, None))
    new, evicted = cache.take_step()
    assert [i.content_hash for i in new] == ["z"] and evicted == ["x"]
    assert "x" not in cache and "y" in cache and "z" in cache
    assert not cache.can_add(1)  # y and z are held


def test_an_entry_added_and_evicted_in_one_step_is_neither_encoded_nor_dropped():
    cache = EncoderCache(capacity=8)
    cache.add("r", ImageInput("x", 0, 8, None))
    cache.release("r")
    cache.add("s", ImageInput("y", 0, 8, None))
    new, evicted = cache.take_step()
    assert [i.content_hash for i in new] == ["y"] and evicted == []
    assert cache.num_encoded == 1


def test_scheduler_releases_an_image_once_its_placeholders_are_computed():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), CacheConfig(block_size=4), 32)
    request = _request("a", ["x"], [4], length=8, total=20)
    request.sampling_params.max_tokens = 4
    sched.add_request(request)
    out = sched.schedule()
    assert [i.content_hash for i in out.encoder_inputs] == ["x"] and out.scheduled[0].num_scheduled_tokens == 8
    sched.update_from_output(out, {})
    assert sched.encoder_cache._holders["x"] == {"a"}  # 4 of its 8 placeholders are still to compute
    out = sched.schedule()
    assert out.encoder_inputs == []  # cached: not encoded again for the next chunk
    sched.update_from_output(out, {})
    assert sched.encoder_cache._holders["x"] == set()
