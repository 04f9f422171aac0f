"""Model families (Llama, Mistral, Qwen2, Qwen3, Phi-3) written against an explicit AttentionMetadata; registry.py
says which family serves each architecture."""

from pagedserve.backend.model.config import SUPPORTED_ARCHITECTURES, ModelArchConfig, UnsupportedModelError
from pagedserve.backend.model.family import ModelFamily, Placement
from pagedserve.backend.model.llama import LlamaForCausalLM
from pagedserve.backend.model.loader import load_eos_token_ids, load_model, load_tokenizer, resolve_dtype
from pagedserve.backend.model.registry import family_for

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "ModelFamily",
    "Placement",
    "UnsupportedModelError",
    "family_for",
    "load_eos_token_ids",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
]
