"""The runner's half of images: the encoder cache's embeddings (by content hash), the encoder pass over a
step's new images in one batch, and the step's input embeddings with each placeholder row replaced by its
image's row. The scheduler (core/multimodal.py) decides what is encoded, kept and dropped."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedserve.backend.core.multimodal import image_runs, images_in
from pagedserve.backend.core.scheduler import ScheduledRequest, SchedulerOutput


class EncoderRunner:
    """Runs a multimodal model's `encode_images` and keeps the embeddings the scheduler's cache lists."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.embeddings: dict[str, torch.Tensor] = {}  # content hash -> [rows, hidden]
        self.num_encoder_calls = 0  # batches run through the encoder
        self.num_images_encoded = 0

    def encode(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the evicted entries, then encode the step's new images in one batch."""
        for content_hash in scheduler_output.evicted_images:
            self.embeddings.pop(content_hash, None)
        images = scheduler_output.encoder_inputs
        if not images:
            return
        rows = self.model.encode_images([image.data for image in images])
        for image, embedding in zip(images, rows, strict=True):
            if embedding.shape[0] != image.length:
                raise RuntimeError(f"image {image.content_hash} gave {embedding.shape[0]} embedding rows for "
                                   f"{image.length} placeholder tokens")
            self.embeddings[image.content_hash] = embedding
        self.num_encoder_calls += 1
        self.num_images_encoded += len(images)

    def positions(self, scheduled: Sequence[ScheduledRequest], positions: torch.Tensor) -> torch.Tensor:
        """The step's positions for the model: M-RoPE's [3, T] (a model with `mrope_positions`, Qwen2-VL) when a
        request of the step has images, each request's rows from its images alone (so decode, chunks, preemption
        and prefix hits agree); else `positions` as they are (a text token's three positions are equal)."""
        if not hasattr(self.model, "mrope_positions") or not any(item.request.mm_inputs for item in scheduled):
            return positions
        rows = [self.model.mrope_positions(item.request.mm_inputs, item.num_computed_tokens, item.num_scheduled_tokens)
                for item in scheduled]
        return torch.cat(rows, dim=1).to(positions.device)

    def bidirectional_ranges(self, scheduled: Sequence[ScheduledRequest], num_tokens: int,
                             device: torch.device) -> torch.Tensor | None:
        """Attention's [T, 2] int32 ranges for a model whose image tokens attend to each other (Gemma 3): row t is
        the [lo, hi) image run token t sits in ([0, 0) outside one); None for another model or a step whose tokens
        sit in no run."""
        if not getattr(self.model, "bidirectional_image_runs", False):
            return None
        ranges = torch.zeros(num_tokens, 2, dtype=torch.int32)
        offset, found = 0, False
        for item in scheduled:
            start, count = item.num_computed_tokens, item.num_scheduled_tokens
            for lo, hi in image_runs(item.request.mm_inputs):
                first, last = max(lo, start), min(hi, start + count)
                if first < last:
                    ranges[offset + first - start : offset + last - start] = torch.tensor([lo, hi], dtype=torch.int32)
                    found = True
            offset += count
        return ranges.to(device) if found else None

    def inputs_embeds(self, scheduled: Sequence[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings [T, H] (`scheduled` in the batch's row order), image rows in place of
        their placeholders'; None when the step reaches no image."""
        rows: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        offset = 0
        for item in scheduled:
            start, count = item.num_computed_tokens, item.num_scheduled_tokens
            for image in images_in(item.request.mm_inputs, start, start + count):
                first, last = max(image.offset, start), min(image.end, start + count)
                rows.append(torch.arange(offset + first - start, offset + last - start))
                parts.append(self.embeddings[image.content_hash][first - image.offset : last - image.offset])
            offset += count
        if not parts:
            return None
        embeds = self.model.embed(input_ids)
        embeds[torch.cat(rows).to(embeds.device)] = torch.cat(parts).to(embeds.dtype)
        return embeds
