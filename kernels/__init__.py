"""Triton-language kernels, each beside its torch reference."""
