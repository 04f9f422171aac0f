"""Images in the core: where a request's image placeholder tokens sit (`ImageInput`), which of them a block or a
step's chunk covers, and the encoder cache's bookkeeping (`EncoderCache`: which images' embeddings the runner
holds, who still needs them, what to evict). The pixels travel as an opaque `data` the core never reads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens are prompt positions offset .. offset + length - 1, each
    taking one row of the image's embeddings; `content_hash` names the image (its processed pixels)."""

    content_hash: str
    offset: int
    length: int
    data: Any  # the processor's tensors for this image, for the model's encoder

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.offset + self.length


def images_in(images: Sequence[ImageInput], start: int, end: int) -> list[ImageInput]:
    """The images (in prompt order) with a placeholder among positions start .. end - 1."""
    return [image for image in images if image.offset < end and image.end > start]


def image_runs(images: Sequence[ImageInput]) -> list[tuple[int, int]]:
    """[lo, hi) of each maximal run of image placeholder positions (images side by side make one run): what a
    model whose image tokens attend to each other (Gemma 3) sees as one block."""
    runs: list[tuple[int, int]] = []
    for image in sorted(images, key=lambda image: image.offset):
        if runs and runs[-1][1] == image.offset:
            runs[-1] = (runs[-1][0], image.end)
        else:
            runs.append((image.offset, image.end))
    return runs


def end_outside_runs(images: Sequence[ImageInput], start: int, num_new: int) -> int:
    """num_new cut so that the chunk start .. start + num_new - 1 does not end strictly inside an image run: it
    stops before the run (0 when it starts inside it: it must take the run to its end or wait)."""
    end = start + num_new
    for lo, hi in image_runs(images):
        if lo < end < hi:
            return max(lo - start, 0)
    return num_new


def block_images_key(images: Sequence[ImageInput], start: int, end: int) -> str | None:
    """The part of a block's hash that names the images whose placeholders positions start .. end - 1 hold, so
    the same placeholder tokens with another image never share KV; None when the block holds none."""
    hashes = [image.content_hash for image in images_in(images, start, end)]
    return "images:" + ",".join(hashes) if hashes else None


class EncoderCache:
    """Which images' embeddings the runner keeps, by content hash, within `capacity` embedding rows.

    An entry is held by the requests whose placeholders of it are not all computed; one held by none stays,
    least recently released first in line for eviction, so a repeated image is encoded once while it fits.
    The runner encodes what `take_step` lists as new and drops what it lists as evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_used = 0  # rows of every entry, held or not
        self._size: dict[str, int] = {}
        self._holders: dict[str, set[str]] = {}
        self._unheld: OrderedDict[str, None] = OrderedDict()
        self._held_by: dict[str, set[str]] = {}  # request id -> hashes it holds
        self._new: dict[str, ImageInput] = {}
        self._evicted: list[str] = []
        self.num_encoded = 0  # images handed to the encoder so far
        # vLLM's vllm:mm_cache_queries / _hits: images a request reaches (again after a preemption), and those
        # whose embeddings were cached or encoded for an earlier occurrence in the same step.
        self.num_queries = 0
        self.num_hits = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._size

    def can_add(self, rows: int) -> bool:
        """Whether `rows` more rows fit, evicting unheld entries."""
        unheld = sum(self._size[h] for h in self._unheld)
        return self.num_used - unheld + rows <= self.capacity

    def add(self, request_id: str, image: ImageInput) -> None:
        """Make room (evicting unheld entries) and list `image` for encoding this step, held by the request."""
        while self.num_used + image.length > self.capacity and self._unheld:
            evicted, _ = self._unheld.popitem(last=False)
            self.num_used -= self._size.pop(evicted)
            del self._holders[evicted]
            if self._new.pop(evicted, None) is None:  # one listed this step is simply not encoded
                self._evicted.append(evicted)
            else:
                self.num_encoded -= 1
        if image.content_hash in self._evicted:  # evicted earlier this step: the runner re-encodes it
            self._evicted.remove(image.content_hash)
        self._size[image.content_hash] = image.length
        self._holders[image.content_hash] = set()
        self.num_used += image.length
        self._new[image.content_hash] = image
        self.num_encoded += 1
        self.hold(request_id, image.content_hash)

    def hold(self, request_id: str, content_hash: str) -> None:
        """The request needs this cached entry's embeddings (its placeholders are not all computed)."""
        self._holders[content_hash].add(request_id)
        self._unheld.pop(content_hash, None)
        self._held_by.setdefault(request_id, set()).add(content_hash)

    def release(self, request_id: str, hashes: Iterable[str] | None = None) -> None:
        """The request no longer needs these entries (None: any it holds); unheld ones stay until evicted."""
        held = self._held_by.get(request_id)
        if not held:
            return
        for content_hash in list(held if hashes is None else hashes):
            if content_hash not in held:
                continue
            held.discard(content_hash)
            holders = self._holders[content_hash]
            holders.discard(request_id)
            if not holders:
                self._unheld[content_hash] = None
        if not held:
            del self._held_by[request_id]

    def take_step(self) -> tuple[list[ImageInput], list[str]]:
        """(images to encode, hashes to drop) since the last call; the runner drops, then encodes."""
        new, evicted = list(self._new.values()), self._evicted
        self._new, self._evicted = {}, []
        return new, evicted


class StepEncoderCache(EncoderCache):
    """The encoder cache with the scheduler's encoder budget (rows of new images one step may encode): the
    scheduler plans a chunk, then commits it once its KV slots are allocated."""

    def __init__(self, capacity: int, budget: int) -> None:
        super().__init__(capacity)
        self.budget = budget
        self.remaining = budget
        self._planned: list[ImageInput] = []
        self._planned_rows = 0
        self._planned_end = 0
        # Set for a model whose image tokens attend to each other (Gemma 3): no chunk ends inside an image run.
        self.whole_runs = False

    def start_step(self) -> None:
        """A new step: its whole encoder budget is free."""
        self.remaining = self.budget

    def plan(self, images: Sequence[ImageInput], start: int, num_new: int) -> int:
        """How many of the chunk's num_new tokens from `start` can run: the images it reaches that are not
        cached are planned for encoding while they fit the step's budget and the cache; the chunk stops before
        the first that does not. A step's first image is encoded even past the budget, so that an image
        larger than it still runs. With `whole_runs` the chunk never ends inside an image run."""
        if self.whole_runs:
            num_new = end_outside_runs(images, start, num_new)
        to_encode: list[ImageInput] = []
        rows = 0
        first = self.remaining == self.budget
        for image in images_in(images, start, start + num_new):
            if image.content_hash in self or any(i.content_hash == image.content_hash for i in to_encode):
                continue
            over_budget = rows + image.length > self.remaining and not (first and not to_encode)
            if over_budget or not self.can_add(rows + image.length):
                num_new = max(image.offset - start, 0)
                break
            to_encode.append(image)
            rows += image.length
        self._planned, self._planned_rows, self._planned_end = to_encode, rows, start + num_new
        return num_new

    def commit(self, request_id: str, images: Sequence[ImageInput], start: int) -> None:
        """Record the chunk just planned as scheduled: its new images listed for encoding, the cached ones
        held."""
        missed = {image.content_hash for image in self._planned if image.content_hash not in self}
        held = set(self._held_by.get(request_id, ()))  # images the request's earlier chunks reached
        for image in self._planned:
            if image.content_hash not in self:
                self.add(request_id, image)
        for image in images_in(images, start, self._planned_end):
            if image.content_hash not in held:  # reached now (after a prefix hit too), not continued
                self.num_queries += 1
                if image.content_hash in missed:
                    missed.discard(image.content_hash)
                else:
                    self.num_hits += 1
            self.hold(request_id, image.content_hash)
        self.remaining -= self._planned_rows
        self._planned, self._planned_rows = [], 0

    def release_computed(self, request_id: str, images: Sequence[ImageInput], num_computed: int) -> None:
        """Let go of the images whose placeholders are all computed now."""
        done = {image.content_hash for image in images if image.end <= num_computed}
        if done:
            # An image repeated later in the prompt stays held until its last placeholders are computed too.
            self.release(request_id, done - {image.content_hash for image in images if image.end > num_computed})
