"""Grouped matmul (ragged dot): `gmm` and its weight gradient `tgmm`.

| file | what |
|---|---|
| _reference.py | the semantics in plain JAX (`lax.ragged_dot`), the reference every backend equals |
| _api.py | `gmm` / `tgmm`: backend choice and the custom VJP |
| _pallas_triton.py | Pallas Triton kernels (NVIDIA, AMD), their tilings per target, the weight-tile loader protocol |
| _pallas_mosaic_tpu.py | JAX's Mosaic megablox kernels (TPU) |
| _pallas_mosaic_gpu.py | tokamax's Mosaic GPU ragged_dot (Hopper, Blackwell; by name only) |
"""

from ._api import gmm, tgmm
from ._pallas_triton import (GMM_TILINGS, TGMM_TILINGS, DenseRhs, GmmConfig, default_gmm_config, default_tgmm_config,
                             group_metadata, grouped_matmul_call, tiling_candidates)
from ._reference import clamp_group_sizes, gmm_reference, tgmm_reference
from ._pallas_mosaic_tpu import TPU_DTYPES

__all__ = ["TPU_DTYPES", "gmm", "tgmm", "gmm_reference", "tgmm_reference", "clamp_group_sizes", "GmmConfig",
           "DenseRhs", "GMM_TILINGS", "TGMM_TILINGS", "default_gmm_config", "default_tgmm_config", "group_metadata",
           "grouped_matmul_call", "tiling_candidates"]
