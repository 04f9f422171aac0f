"""Llama-family model definitions written against an explicit AttentionMetadata."""
