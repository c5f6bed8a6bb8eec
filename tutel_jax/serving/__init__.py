"""Serving: autoregressive generation with a static KV cache (greedy or seeded sampling; stop tokens, early
stopping and a per-token stream callback), the `generate` command and the OpenAI-compatible server."""

from ._generate import GenerationResult, generate, left_align, sample_rows
from ._sampling import NonFiniteLogitsError, SamplingParamError, SamplingParams, check_sampling
from ._steps import decode_step, prefill_step, row_sampling, sampling_arrays, trim_bias

__all__ = ["decode_step", "prefill_step", "row_sampling", "sampling_arrays", "trim_bias", "GenerationResult",
           "NonFiniteLogitsError", "SamplingParamError", "SamplingParams", "check_sampling", "generate", "left_align",
           "sample_rows"]
