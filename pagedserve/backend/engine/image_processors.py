"""The model folder's transformers processor, and each image's share of what it returns.

Qwen2-VL's processors (transformers 5) also load a video processor, which needs torchvision; no torchvision
build on PyPI matches the pinned CPU torch, so where that import fails the processor class the folder names is
built from its image processor (AutoImageProcessor, which falls back to the Pillow one) and tokenizer alone:
transformers' own class then expands the image placeholders as it always does, and videos stay unsupported."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any


def load_processor(model_path: str) -> Any:
    """transformers' AutoProcessor of the folder (local files only), or its image-only form (above)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, local_files_only=True)
    except ImportError:
        processor = _image_only_processor(model_path)
        if processor is None:
            raise
        return processor


def _processor_class_name(model_path: str) -> str | None:
    """The processor class the folder's configs name (processor, image processor or tokenizer config)."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = Path(model_path) / name
        if path.is_file():
            found = json.loads(path.read_text()).get("processor_class")
            if found:
                return str(found)
    return None


def _image_only_processor(model_path: str) -> Any | None:
    """The folder's processor class over its image processor and tokenizer, without the video processor;
    None where the class takes no video processor (the failure was something else)."""
    import transformers

    name = _processor_class_name(model_path)
    base = getattr(transformers, name, None) if name else None
    parameters = inspect.signature(base.__init__).parameters if base is not None else {}
    if "video_processor" not in parameters:
        return None

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"{base.__name__}ImageOnly"
    images = transformers.AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return ImageOnly(image_processor=images, tokenizer=tokenizer, video_processor=None, **_settings(model_path,
                                                                                                    parameters))


def _settings(model_path: str, parameters: Any) -> dict[str, Any]:
    """The processor's own settings its processor_config.json holds (image_seq_len, say)."""
    path = Path(model_path) / "processor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    skip = {"self", "image_processor", "tokenizer", "video_processor", "chat_template", "kwargs"}
    return {key: value for key, value in saved.items() if key in parameters and key not in skip}


def per_image(out: Any, count: int) -> list[dict[str, Any]]:
    """Each of the `count` images' tensors: pixel_values [N, ...] one row an image, or (Qwen2-VL's patches of
    every image in one [patches, values] tensor) split by image_grid_thw's patch counts, with its grid row; or
    each tile's where the processor tiles its images (Idefics3's [1, tiles, C, S, S]): more entries than images."""
    pixels = out["pixel_values"]
    if pixels.dim() == 5:
        return _tiles(pixels, out.get("pixel_attention_mask"))
    grids = out.get("image_grid_thw")
    if grids is None:
        return [{"pixel_values": pixels[i : i + 1]} for i in range(count)]
    chunks = pixels.split(grids.prod(-1).tolist())
    return [{"pixel_values": chunk, "image_grid_thw": grids[i : i + 1]} for i, chunk in enumerate(chunks)]


def _tiles(pixels: Any, masks: Any) -> list[dict[str, Any]]:
    """One prompt's tiles, each [1, C, S, S]; a tile with padding (a part of its mask off, which the tile
    encoders here do not mask) is refused naming images."""
    from pagedserve.backend.core.errors import InvalidRequestError

    if masks is not None and not bool(masks.bool().all()):
        raise InvalidRequestError("an image tile with padding is not supported (keep the processor's image "
                                  "splitting on)", "images")
    return [{"pixel_values": pixels[0, i : i + 1]} for i in range(pixels.shape[1])]
