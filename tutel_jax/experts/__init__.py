"""The routed and shared experts: the `Experts` protocol and registry with Tutel's `ffn` and `llama_ffn`
(`base`), SwiGLU and GPT-OSS experts (`glu`), dense shared experts (`shared`), the experts' one matmul primitive
(`grouped_linear`), the dense linear layer (`linear`), the expert loop (`loop`) and the dropless-path registry
(`dropless`)."""

from ._base import Experts, FFNExperts, LlamaFFNExperts, as_experts, make_experts, register_experts
from ._glu import GptOssExperts, SwiGLUExperts
from ._shared import SharedExperts, make_shared_experts
from ._dropless import (DroplessPath, IMPLS, bucket_capacities, bucket_index, check_native, impl_names,
                        register_dropless_path, resolve_impl, DROPLESS_PATHS, extend_for_cpu, run_bucketed)
from ._linear import (DENSE_IMPLS, check_dense_impl, head_linear, linear, matmul_out_in, native_activations,
                      xla_weight)
from ._grouped_linear import batched_linear, gathered_linear, grouped_linear

from . import _loop as expert_loop  # the expert loop (`expert_loop.grouped`)

__all__ = ["expert_loop", "DROPLESS_PATHS", "extend_for_cpu", "run_bucketed", "DENSE_IMPLS", "DroplessPath", "IMPLS",
           "bucket_capacities", "bucket_index", "check_dense_impl", "check_native", "head_linear", "impl_names",
           "linear", "matmul_out_in", "native_activations", "register_dropless_path", "resolve_impl", "Experts",
           "FFNExperts", "LlamaFFNExperts", "SwiGLUExperts", "GptOssExperts", "SharedExperts", "as_experts",
           "make_experts", "make_shared_experts", "register_experts", "batched_linear", "grouped_linear",
           "gathered_linear", "xla_weight"]
