"""`ServerConfig`: the server's settings, one field per `tutel-jax serve` flag."""

from __future__ import annotations

import dataclasses

from ..layer import Execution

__all__ = ["ServerConfig"]

MIB = 1 << 20


@dataclasses.dataclass
class ServerConfig:
    max_batch_size: int = 16        # rows (prompts x n) per generate call / continuous cache rows; a request's
                                    # prompts x n must fit it
    batch_wait_ms: float = 5.0      # how long the worker gathers requests after the first one (continuous: of
                                    # an idle engine, at least a quarter of its last decode step)
    batching: str = "continuous"    # or "bucketed"
    max_len: int | None = None      # continuous: cache slots per row (default: the context, at most 2048);
                                    # it also caps prompt + max_tokens
    row_buckets: bool = True        # continuous: a decode step runs only the leading power-of-two rows that
                                    # hold running requests (one compile per power of two)
    max_queue: int = 256            # requests waiting or running; beyond: 429
    max_tokens_limit: int = 512     # upper bound on a request's max_tokens
    max_n: int = 16
    default_max_tokens: int = 16    # /v1/completions without max_tokens (chat: up to max_tokens_limit)
    model_name: str | None = None   # the served model id (default: the checkpoint directory's name); requests
                                    # naming another model get 404 model_not_found
    warmup_batch_sizes: list[int] | None = None    # compiled at startup (rows); default [1]
    warmup_prompt_lens: list[int] | None = None    # with these prompt lengths; default [1]
    warmup_max_tokens: int = 2
    execution: Execution = Execution()  # how the loaded model runs: kernels, dropless path, dense path, per-layer
                                        # programs (`tutel_jax.layer._execution`; unset fields: the library's defaults)
    dtype: str = "auto"             # the model's float dtype when the app loads it ('auto', 'float32' or 'bfloat16')
    max_request_bytes: int = 4 * MIB  # a larger body is answered 413 before it is read
    read_timeout_s: float = 30.0    # a request whose headers or body take longer to arrive is answered 408
    template_max_chars: int = 4 * MIB   # a chat template's rendered prompt, and any value it builds, at most
    template_max_iterations: int = 1_000_000  # loop iterations of one chat template render, all loops together
    template_timeout_s: float = 2.0  # a chat template render that takes longer fails (400 on `messages`)
