"""Serving: autoregressive generation with a static KV cache (greedy or seeded sampling; stop tokens, early
stopping and a per-token stream callback), the `generate` command and the OpenAI-compatible server."""

from .generate import GenerationResult, generate, left_align, sample_rows
from .sampling import NonFiniteLogitsError, SamplingParamError, SamplingParams, check_sampling

__all__ = ["GenerationResult", "NonFiniteLogitsError", "SamplingParamError", "SamplingParams", "check_sampling",
           "generate", "left_align", "sample_rows"]
