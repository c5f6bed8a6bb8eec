"""The supported HF model families, one module each; importing this package registers them all.

To add a family: write `<model_type>.py` here (a `Family` passed to `register_family`, see `models.family`) and
import it below. Lookups: `family_of(config)`, `get_family(model_type)`, `family_names()`.
"""

from ..family import Family, SharedExpertTensors, family_names, family_of, get_family, register_family

from . import qwen3_moe, qwen2_moe, mixtral, deepseek_v3, glm4_moe, gpt_oss, olmoe  # noqa: E402,F401  (register)

__all__ = ["Family", "SharedExpertTensors", "family_names", "family_of", "get_family", "register_family"]
