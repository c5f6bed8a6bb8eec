"""Serving: autoregressive generation with a static KV cache (greedy or seeded sampling; stop tokens, early
stopping and a per-token stream callback), the `generate` command (`generate_main`) and the OpenAI-compatible
server (`serve_main`; FastAPI and uvicorn, the `serve` extra, are imported only when it serves)."""

from ._generate import GenerationResult, generate, left_align, sample_rows
from ._sampling import NonFiniteLogitsError, SamplingParamError, SamplingParams, check_sampling
from ._steps import decode_step, prefill_step, row_sampling, sampling_arrays, trim_bias
from ._generate_cli import main as generate_main
from ._server import main as serve_main

__all__ = ["decode_step", "prefill_step", "row_sampling", "sampling_arrays", "trim_bias", "GenerationResult",
           "NonFiniteLogitsError", "SamplingParamError", "SamplingParams", "check_sampling", "generate", "left_align",
           "sample_rows", "generate_main", "serve_main"]
