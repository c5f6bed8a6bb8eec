"""What the compressed-tensors formats (NVFP4 `nvfp4-pack-quantized`, int8 `int-quantized`) share in a
config.json `quantization_config`: the `ignore` list of modules left unquantized."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["METHOD", "ignored"]

#: the config's quant_method of every compressed-tensors checkpoint (its `format` says which one)
METHOD = "compressed-tensors"


def ignored(module: str, q: Mapping[str, Any]) -> bool:
    """Whether `ignore` names `module` (exact module names, or `re:<regex>` matched against the whole name)."""
    patterns = list(q.get("ignore") or [])
    return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module for p in patterns)
