"""Interop with `transformers` (an optional dependency): weights of its MoE blocks."""
