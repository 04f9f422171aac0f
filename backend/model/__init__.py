"""Llama-family model definitions written against an explicit AttentionMetadata."""

from pagedserve.backend.model.config import SUPPORTED_ARCHITECTURES, ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.loader import load_eos_token_ids, load_model, load_tokenizer, resolve_dtype

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "UnsupportedModelError",
    "load_eos_token_ids",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
]
