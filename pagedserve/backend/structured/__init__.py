"""Structured outputs (JSON schema, regex, choice, grammar) with xgrammar: each spec compiled once per engine
(`grammar.py`), a matcher per sequence, one token bitmask per step applied to the logits (`mask.py`, through
`pagedserve/kernels/bitmask/`). The request-side check of a schema's keywords is `core/schema_support.py`
(the core imports no other layer)."""

from pagedserve.backend.structured.grammar import GrammarState, StructuredOutputs, no_control_words
from pagedserve.backend.structured.mask import mask_logits

__all__ = ["GrammarState", "StructuredOutputs", "mask_logits", "no_control_words"]
