"""Byte-level MoE language models on tutel-jax: a Qwen3-MoE-style decoder's size, init, loss, evaluation and
HF export (`model`), the training corpus (`corpus`: source files as bytes, split by file path), and the byte
tokenizer (`byte_tokenizer`: token id = UTF-8 byte).

    from tutel_jax.lm import ByteCorpus, LMSize, init_lm, lm_loss, lm_eval, bits_per_byte, export_lm
"""

from . import _byte_tokenizer as byte_tokenizer
from ._corpus import ByteCorpus, local_rows
from ._model import LMSize, bits_per_byte, causal_context, export_lm, init_lm, lm_eval, lm_loss, moe_config
from ._byte_tokenizer import write_tokenizer

__all__ = ["write_tokenizer", "ByteCorpus", "LMSize", "bits_per_byte", "byte_tokenizer", "causal_context",
           "export_lm", "init_lm", "lm_eval", "lm_loss", "local_rows", "moe_config"]
