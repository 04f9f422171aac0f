"""A prompt's images made ready for the engine: decoded (Pillow, its pixel limit kept), processed by the model's
own transformers processor (AutoProcessor: resize, normalise, patchify, and each placeholder expanded into the
model's image tokens), and described as the core's `ImageInput`s with a content hash each. `process_async`
runs it on a thread of its own, so the engine thread steps on meanwhile (as grammar compilation does)."""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.multimodal import ImageInput, image_runs
from pagedserve.backend.engine.image_processors import load_processor, per_image

FIELD = "images"


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt with its images processed: token ids with every placeholder expanded, and the images."""

    token_ids: list[int]
    images: tuple[ImageInput, ...]


class ImageProcessor:
    """The model folder's processor (loaded on first use) and the image token its placeholders expand into."""

    def __init__(self, model_path: str, image_token_id: int, max_images: int | None = None):
        self.model_path = model_path
        self.image_token_id = image_token_id
        self.max_images = max_images  # limit_mm_per_prompt's image count; None: no limit of the engine's
        self._processor: Any = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def processor(self) -> Any:
        """transformers' AutoProcessor of the model folder, from local files only."""
        with self._lock:
            if self._processor is None:
                self._processor = load_processor(self.model_path)
            return self._processor

    def process_async(self, prompt: object, images: object, add_special_tokens: bool = True) -> Future:
        """A future of `process(...)`, run on the processing thread."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-images")
        return self._pool.submit(self.process, prompt, images, add_special_tokens)

    def process(self, prompt: object, images: object, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Decode and process the images with the prompt; bad input raises InvalidRequestError naming `prompt`
        or `images`."""
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("a prompt with images must be a non-empty text prompt holding the "
                                      "model's image placeholders", "prompt")
        images = _as_list(images)
        if self.max_images is not None and len(images) > self.max_images:  # checked before any is decoded
            raise InvalidRequestError(f"at most {self.max_images} image(s) may be provided in one prompt "
                                      f"(limit_mm_per_prompt), got {len(images)}", FIELD)
        pictures = [decode_image(image, index) for index, image in enumerate(images)]
        processor = self.processor()
        placeholder = getattr(processor, "image_token", None)
        if placeholder is not None and prompt.count(placeholder) != len(pictures):
            raise InvalidRequestError(f"the prompt holds {prompt.count(placeholder)} image placeholders "
                                      f"({placeholder}) for {len(pictures)} images", FIELD)
        try:
            out = processor(text=prompt, images=pictures, return_tensors="pt", add_special_tokens=add_special_tokens)
        except (ValueError, OSError) as error:
            raise InvalidRequestError(f"the images could not be processed: {error}", FIELD) from error
        token_ids = out["input_ids"][0].tolist()
        parts = per_image(out, len(pictures))
        # A tiled image (Idefics3's tiles, text between) is one ImageInput a tile, each tile its own run of tokens.
        lengths = _image_lengths(processor, pictures, token_ids, self.image_token_id) if len(parts) == len(
            pictures) else None
        spans = placeholder_spans(token_ids, self.image_token_id, lengths)
        if len(spans) != len(parts):
            raise InvalidRequestError(f"the prompt's image tokens make {len(spans)} runs for {len(parts)} image "
                                      "tiles", FIELD)
        inputs = tuple(ImageInput(_content_hash(data), offset, length, data)
                       for data, (offset, length) in zip(parts, spans, strict=True))
        return ProcessedPrompt(token_ids, inputs)

    def close(self) -> None:
        """Stop the processing thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _as_list(images: object) -> list[Any]:
    if isinstance(images, (bytes, bytearray)) or not isinstance(images, Sequence) or isinstance(images, str):
        images = [images]
    if not images:
        raise InvalidRequestError("images must not be empty", FIELD)
    return list(images)


def decode_image(image: object, index: int) -> Any:
    """A PIL image from image-file bytes or a PIL image, fully decoded; a decompression bomb (Pillow's pixel
    limit), a truncated file or bytes that are no image are refused naming images[index]."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if not isinstance(image, (bytes, bytearray)):
        raise InvalidRequestError(f"images[{index}] must be image file bytes or a PIL image, got "
                                  f"{type(image).__name__}", FIELD)
    try:
        picture = Image.open(io.BytesIO(bytes(image)))
        picture.load()
    except Image.DecompressionBombError as error:
        raise InvalidRequestError(f"images[{index}] has too many pixels: {error}", FIELD) from error
    except (OSError, SyntaxError, ValueError) as error:  # Pillow's errors for unknown, bad or truncated files
        raise InvalidRequestError(f"images[{index}] is not a readable image file: {error}", FIELD) from error
    return picture


def placeholder_spans(token_ids: Sequence[int], image_token_id: int,
                      lengths: Sequence[int] | None) -> list[tuple[int, int]]:
    """(offset, length) of each image's placeholder tokens: the image tokens in order, `lengths[i]` of them
    for image i (images placed side by side make one run), each image's contiguous; None: each run."""
    positions = [position for position, token in enumerate(token_ids) if token == image_token_id]
    if lengths is None:
        runs: list[tuple[int, int]] = []
        for position in positions:
            if runs and sum(runs[-1]) == position:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((position, 1))
        return runs
    if len(positions) != sum(lengths):
        raise InvalidRequestError(f"the prompt holds {len(positions)} image tokens where its images take "
                                  f"{sum(lengths)}", FIELD)
    spans: list[tuple[int, int]] = []
    for length in lengths:
        first = positions[sum(span[1] for span in spans)]
        if positions[sum(span[1] for span in spans) + length - 1] != first + length - 1:
            raise InvalidRequestError("an image's placeholder tokens are not contiguous in the prompt", FIELD)
        spans.append((first, length))
    return spans


def _image_lengths(processor: Any, pictures: list[Any], token_ids: Sequence[int], image_token_id: int) -> list[int]:
    """How many image tokens each image expanded into: its run of them where the runs are one an image, else
    the processor's own count, else (a processor without one) an even share, as images of one fixed size take."""
    runs = [length for _, length in placeholder_spans(token_ids, image_token_id, None)]
    if len(runs) == len(pictures):
        return runs
    try:
        sizes = [(picture.height, picture.width) for picture in pictures]
        return list(processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"])
    except (AttributeError, KeyError, TypeError):
        return [sum(runs) // len(pictures)] * len(pictures)


def _content_hash(data: dict[str, Any]) -> str:
    """The digest of an image's processed tensors (shapes and dtypes included): what the encoder sees names the
    image."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(data.items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def prompt_with_images(processor: ImageProcessor | None, prompt: object, images: object, add_special_tokens: bool,
                       params: Any, scheduler_config: Any, engine_core: Any) -> ProcessedPrompt:
    """The request's prompt processed with its images (or as `images` already processed, a ProcessedPrompt),
    checked against what the engine serves with images and against its limits."""
    from pagedserve.backend.engine.spec_decode.draft_model import DraftModelSpeculator

    if processor is None:
        raise InvalidRequestError("this model takes no images (a text-only architecture)", FIELD)
    if engine_core.workers is not None:
        raise InvalidRequestError("images are not served under tensor parallelism yet", FIELD)
    if isinstance(engine_core.speculator, DraftModelSpeculator):
        raise InvalidRequestError("images are not served with a draft model's speculation (its model sees no "
                                  "image)", FIELD)
    if params.truncate_prompt_tokens is not None:
        raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
    if isinstance(images, Future):  # processed on the image thread (process_async): its result or refusal
        images = images.result()
    processed = images if isinstance(images, ProcessedPrompt) else processor.process(prompt, images,
                                                                                    add_special_tokens)
    num_tokens, max_model_len = len(processed.token_ids), scheduler_config.max_model_len
    if num_tokens >= max_model_len:
        image_tokens = sum(image.length for image in processed.images)
        raise InvalidRequestError(f"the prompt is {num_tokens} tokens with its images' {image_tokens}; it must be "
                                  f"shorter than max_model_len ({max_model_len})", "prompt")
    largest = max(image.length for image in processed.images)
    if largest > scheduler_config.encoder_cache_rows:
        raise InvalidRequestError(f"an image of {largest} tokens does not fit the encoder cache "
                                  f"({scheduler_config.encoder_cache_rows} rows; raise encoder_cache_size)", FIELD)
    longest = max(hi - lo for lo, hi in image_runs(processed.images))
    if engine_core.scheduler.encoder_cache.whole_runs and longest > scheduler_config.max_num_batched_tokens:
        raise InvalidRequestError(f"an image run of {longest} tokens attends within itself, so it is prefilled in "
                                  f"one step, which holds at most max_num_batched_tokens "
                                  f"({scheduler_config.max_num_batched_tokens}) tokens", FIELD)
    return processed
