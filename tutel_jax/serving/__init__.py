"""Serving: autoregressive generation with a static KV cache (greedy or seeded sampling)."""

from .generate import GenerationResult, generate, left_align, sample_next

__all__ = ["GenerationResult", "generate", "left_align", "sample_next"]
