"""Dispatch (encode), combine (decode) and the dropless permute / unpermute pair.

| file | what |
|---|---|
| _reference.py | index gathers with custom VJPs in plain JAX, the reference every backend equals |
| _api.py | `encode` / `decode` / `permute` / `unpermute`: backend choice and the custom VJPs |
| _pallas_triton.py | Pallas Triton kernels (NVIDIA, AMD) and their tilings per target |
| _pallas_mosaic_tpu.py | a Mosaic row-gather kernel (TPU) |
"""

from ._api import decode, encode, permute, unpermute
from ._pallas_triton import DISPATCH_TILINGS, DispatchConfig, DispatchTiling, default_dispatch_config, row_dots_config
from ._reference import (decode_reference, encode_reference, gather_encode, grouped_rows, row_dots_reference,
                         slot_owner)

__all__ = ["encode", "decode", "permute", "unpermute", "encode_reference", "decode_reference", "row_dots_reference",
           "gather_encode", "grouped_rows", "slot_owner", "DispatchConfig", "DispatchTiling", "DISPATCH_TILINGS",
           "default_dispatch_config", "row_dots_config"]
