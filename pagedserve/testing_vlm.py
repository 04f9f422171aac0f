"""Tiny random-weight vision-language models beside pagedserve/testing.py's (which is at its size limit): Gemma 3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.testing import (
    BOS_TOKEN,
    CHATML_TEMPLATE,
    END_OF_TEXT,
    EOS_TOKEN,
    _ensure_chat_template_in_config,
    _save,
    _widen_init,
    build_tokenizer,
)

GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_IMAGE = GEMMA3_TOKENS["boi_token"]  # one image's placeholder in a prompt


def make_tiny_gemma3_vl(path: str | Path, seed: int = 0, *, mm_tokens_per_image: int = 9,
                        text_sizes: dict[str, Any] | None = None, vision_sizes: dict[str, Any] | None = None) -> Path:
    """Save a tiny random-weight Gemma3ForConditionalGeneration: a 3-layer SigLIP tower over 42-pixel images of
    7-pixel patches (6x6), average-pooled to `mm_tokens_per_image` (3x3 = 9) tokens an image; a Gemma 3 text decoder
    whose every second layer slides over a window of 8 tokens (shorter than an image's run of tokens plus its
    markers, so windows cut into images), with transformers' Gemma3Processor (its Pillow image processor) and the
    tiny tokenizer with Gemma 3's image tokens, which the processor expands each GEMMA3_IMAGE into."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = build_tokenizer()
    base.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    base.add_tokens(["\n", "\n\n", "\n\n\n", "\n\n\n\n"])  # Gemma's vocabulary has these (vLLM's processor looks them up)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=END_OF_TEXT,
        extra_special_tokens=GEMMA3_TOKENS)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=42,
                  patch_size=7, vision_use_head=False)
    vision = {**vision, **(vision_sizes or {})}  # a benchmark's larger one
    side = int(vision["image_size"])
    images = transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=mm_tokens_per_image,
                                 chat_template=CHATML_TEMPLATE).save_pretrained(path)
    _ensure_chat_template_in_config(path)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("bos_token_id", BOS_TOKEN), ("eos_token_id", EOS_TOKEN), ("pad_token_id", END_OF_TEXT))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                max_position_embeddings=1024, rms_norm_eps=1e-5, sliding_window=8, sliding_window_pattern=2,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                tie_word_embeddings=False, **ids)  # tied, this tiny decoder would echo its last token
    text = {**text, **(text_sizes or {})}
    token_ids = {f"{name}_index": tokenizer.convert_tokens_to_ids(tok) for name, tok in
                 (("boi_token", GEMMA3_TOKENS["boi_token"]), ("eoi_token", GEMMA3_TOKENS["eoi_token"]),
                  ("image_token", GEMMA3_TOKENS["image_token"]))}
    config = transformers.Gemma3Config(text_config=text, vision_config={"model_type": "siglip_vision_model", **vision},
                                       mm_tokens_per_image=mm_tokens_per_image, tie_word_embeddings=False,
                                       **token_ids, **ids)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    _widen_init(model, random_norms=True)
    with torch.no_grad():  # zeros at init: drawn, so the projection (and its orientation) shows in the tokens
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    _save(model, path, None)
    return path
