"""Pallas kernels for tutel-jax: gating, dispatch/combine, grouped matmul, quantized matmul.

One folder per op (tokamax's layout): `reference.py` holds the op's semantics in plain JAX, `api.py` the op with
its backend choice (and custom VJP), and each backend sits beside them: `pallas_triton.py` (NVIDIA and AMD GPUs,
tiled per GPU target, see targets.py and the offline compile in offline/), `pallas_mosaic_tpu.py` (TPUs),
`_pallas_mosaic_gpu.py` (tokamax's Mosaic GPU ragged_dot on Hopper / Blackwell, by name only). Every op has the
signature `op(..., implementation="auto", config=None)`. The package depends on JAX only:

| op | folder | reference |
|---|---|---|
| `gating`, `slot_positions` | gating/ | softmax/sigmoid(+bias, group-limited) -> top-k -> Tutel slots |
| `encode`, `decode`, `permute`, `unpermute` | dispatch/ | index gathers with custom VJPs |
| `gmm`, `tgmm` | gmm/ | `lax.ragged_dot` (custom VJP: d lhs = gmm, d rhs = tgmm) |
| `quant_matmul`, `quant_gmm` | quant/ | dequantize (quant/formats/) then float32 matmul |

`implementation`: "auto" (the kernel of the platform the program is compiled for: Triton on GPUs, Mosaic on
TPUs where the op has one, with the XLA reference as fallback; the reference on CPUs; see `_select.py`;
overridable by the environment variable `TUTEL_JAX_KERNELS`), "xla", "pallas" (Triton), "interpret" (the Triton
kernel through Pallas' CPU interpreter, for tests), "tpu" (Mosaic TPU), "tpu_interpret" or "mosaic_gpu". `config`: the op's
frozen tiling dataclass (defaults chosen from the shapes). On a CPU nothing changes unless a kernel is asked
for explicitly.
"""

from ._select import (ENV_VAR, IMPLEMENTATIONS, NotSupported, choose, environment_choice, gpu_backend, resolve,
                      resolved_name)
from .targets import (DEFAULT_TARGET, PLATFORMS, TARGETS, Target, compile_platform, current_target, get_target,
                      lowering_context, use_target)
from .dispatch import (DispatchConfig, decode, decode_reference, default_dispatch_config, encode,
                       encode_reference, gather_encode, grouped_rows, permute, row_dots_reference, slot_owner,
                       unpermute)
from .gating import (GatingConfig, GatingResult, default_gating_config, gating, gating_reference, slot_positions,
                     slot_positions_reference)
from .gmm import (GmmConfig, default_gmm_config, default_tgmm_config, gmm, gmm_reference, group_metadata, tgmm,
                  tgmm_reference)
from .quant import (E2M1_LUT, Fp8BlockWeight, Fp8ChannelWeight, Int8Weight, Mxfp4Weight, Nvfp4Weight, QuantizedWeight,
                    dequant_channel, dequant_fp8_block, dequant_mxfp4, dequant_nvfp4, quantize_fp8_block,
                    quantize_fp8_channel, quantize_int8, quantize_mxfp4, quantize_nvfp4)
from .quant import (QuantMatmulConfig, default_quant_config, quant_gmm, quant_gmm_reference, quant_matmul,
                    quant_matmul_reference)

__all__ = [
    # selection
    "ENV_VAR", "IMPLEMENTATIONS", "NotSupported", "choose", "environment_choice", "gpu_backend", "resolve",
    "resolved_name",
    # targets (GPU generations: tilings and code paths)
    "DEFAULT_TARGET", "PLATFORMS", "TARGETS", "Target", "compile_platform", "current_target", "get_target",
    "lowering_context", "use_target",
    # gating
    "GatingConfig", "GatingResult", "default_gating_config", "gating", "gating_reference", "slot_positions",
    "slot_positions_reference",
    # dispatch
    "DispatchConfig", "default_dispatch_config", "encode", "decode", "permute", "unpermute", "grouped_rows",
    "encode_reference", "decode_reference", "row_dots_reference", "gather_encode", "slot_owner",
    # grouped matmul
    "GmmConfig", "default_gmm_config", "default_tgmm_config", "gmm", "tgmm", "gmm_reference", "tgmm_reference",
    "group_metadata",
    # quantized
    "E2M1_LUT", "Fp8BlockWeight", "Fp8ChannelWeight", "Int8Weight", "Mxfp4Weight", "Nvfp4Weight", "QuantizedWeight",
    "dequant_channel", "dequant_fp8_block", "dequant_mxfp4", "dequant_nvfp4", "quantize_fp8_block",
    "quantize_fp8_channel", "quantize_int8", "quantize_mxfp4", "quantize_nvfp4",
    "QuantMatmulConfig", "default_quant_config", "quant_matmul", "quant_gmm", "quant_matmul_reference",
    "quant_gmm_reference",
    # registry (tokamax style: ordered implementations per op)
    "OPS",
]

#: op name -> (kernel function with `implementation=`, its reference); "auto" tries the kernel then the reference
OPS = {
    "gating": (gating, gating_reference),
    "slot_positions": (slot_positions, slot_positions_reference),
    "encode": (encode, encode_reference),
    "decode": (decode, decode_reference),
    "gmm": (gmm, gmm_reference),
    "tgmm": (tgmm, tgmm_reference),
    "quant_matmul": (quant_matmul, quant_matmul_reference),
    "quant_gmm": (quant_gmm, quant_gmm_reference),
}
