"""Serving: autoregressive generation with a static KV cache (greedy or seeded sampling; stop tokens, early
stopping and a per-token stream callback), the `generate` command and the OpenAI-compatible server."""

from .generate import GenerationResult, generate, left_align, sample_next

__all__ = ["GenerationResult", "generate", "left_align", "sample_next"]
