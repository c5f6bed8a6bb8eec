"""The supported HF model families, one module each; importing this package registers them all.

To add a family: write `_<model_type>.py` here (a `Family` passed to `register_family`, see `models.family`) and
import it below. Lookups: `family_of(config)`, `get_family(model_type)`, `family_names()`.
"""

from .._family import Family, SharedExpertTensors, family_names, family_of, get_family, register_family

from . import _qwen3_moe, _qwen2_moe, _mixtral, _deepseek_v3, _glm4_moe, _gpt_oss, _olmoe  # noqa: E402,F401  (register)

__all__ = ["Family", "SharedExpertTensors", "family_names", "family_of", "get_family", "register_family"]
