"""`dtype='auto'` (the default of `tutel-jax generate` and `tutel-jax serve`): the checkpoint's own float dtype
where it is bfloat16, else float32. On the bfloat16 fixtures (quantized GPT-OSS, Qwen3-MoE NVFP4, DeepSeek-V3
FP8) the greedy tokens equal the float32 model's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from support.paths import HF
from tutel_jax.cli import main
from tutel_jax.models import from_pretrained
from tutel_jax.models._quant_layout import auto_compute_dtype, stored_float_dtype
from tutel_jax.serving import generate

PROMPT = np.array([[3, 17, 42, 5, 9, 11]], np.int32)


def test_auto_is_the_checkpoints_bfloat16_else_float32():
    assert auto_compute_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert auto_compute_dtype({"dtype": "torch.bfloat16"}) == "bfloat16"
    assert auto_compute_dtype({"dtype": "float16"}) == "float32"  # no fast float16 path on CPUs
    assert auto_compute_dtype({"dtype": "float32"}) == "float32"
    assert stored_float_dtype({}) == "bfloat16"  # HF's default
    with pytest.raises(ValueError, match="config dtype 'int8' is not a checkpoint float dtype"):
        auto_compute_dtype({"dtype": "int8"})


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "qwen3_moe_nvfp4", "deepseek_v3_fp8"])
def test_auto_loads_bfloat16_checkpoints_in_bfloat16_with_the_float32_greedy_tokens(name):
    auto = from_pretrained(HF / name, dtype="auto")
    full = from_pretrained(HF / name, dtype=jnp.float32)
    assert jnp.dtype(auto.dtype) == jnp.bfloat16
    np.testing.assert_array_equal(generate(auto, PROMPT, max_new_tokens=12).tokens,
                                  generate(full, PROMPT, max_new_tokens=12).tokens)


def test_auto_keeps_a_float32_checkpoint_float32():
    assert jnp.dtype(from_pretrained(HF / "qwen3_moe", dtype="auto").dtype) == jnp.float32


def test_generate_command_takes_dtype(capsys):
    assert main(["generate", str(HF / "gpt_oss_mxfp4"), "--ids", "3,17,42", "--max-new-tokens", "2",
                 "--dtype", "float32"]) == 0
    assert main(["generate", str(HF / "gpt_oss_mxfp4"), "--ids", "3,17,42", "--max-new-tokens", "2"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["generate", str(HF / "gpt_oss_mxfp4"), "--ids", "1", "--dtype", "float64"])
    assert e.value.code == 2 and "--dtype: invalid choice: 'float64'" in capsys.readouterr().err
