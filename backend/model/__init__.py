"""Llama-family model definitions written against an explicit AttentionMetadata."""

from .config import SUPPORTED_ARCHITECTURES, ModelArchConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .loader import load_eos_token_ids, load_model, load_tokenizer, resolve_dtype

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
