"""Which model family serves each config.json `architectures` name: the one table a new family adds a line to."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.backend.model.family import ModelFamily

# Architecture name -> the module of pagedserve/backend/model/ whose FAMILIES dict holds its ModelFamily.
_FAMILY_MODULES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen_moe",
    "Qwen3MoeForCausalLM": "qwen_moe",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "XLMRobertaModel": "xlm_roberta",
    "XLMRobertaForSequenceClassification": "xlm_roberta",
    "ModernBertModel": "modernbert",
    "ModernBertForSequenceClassification": "modernbert",
    "LlamaForSequenceClassification": "seq_classifier",
    "MistralForSequenceClassification": "seq_classifier",
    "Qwen2ForSequenceClassification": "seq_classifier",
    "Qwen3ForSequenceClassification": "seq_classifier",
    "LlavaForConditionalGeneration": "llava",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Idefics3ForConditionalGeneration": "idefics3",
    "Gemma3ForConditionalGeneration": "gemma3_vl",
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_FAMILY_MODULES))


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its features is outside what pagedserve runs."""


def family_for(architecture: str) -> ModelFamily:
    """The family serving `architecture`; UnsupportedModelError naming it and the supported ones otherwise."""
    if architecture not in _FAMILY_MODULES:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module = importlib.import_module(f"pagedserve.backend.model.{_FAMILY_MODULES[architecture]}")
    return module.FAMILIES[architecture]
