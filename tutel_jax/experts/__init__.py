"""The routed and shared experts: the `Experts` protocol and registry with Tutel's `ffn` and `llama_ffn`
(`base`), SwiGLU and GPT-OSS experts (`glu`), dense shared experts (`shared`), the experts' one matmul primitive
(`grouped_linear`), the dense linear layer (`linear`), the expert loop (`loop`) and the dropless-path registry
(`dropless`)."""

from .base import Experts, FFNExperts, LlamaFFNExperts, as_experts, make_experts, register_experts
from .glu import GptOssExperts, SwiGLUExperts
from .shared import SharedExperts, make_shared_experts

__all__ = ["Experts", "FFNExperts", "LlamaFFNExperts", "SwiGLUExperts", "GptOssExperts", "SharedExperts",
           "as_experts", "make_experts", "make_shared_experts", "register_experts"]
