"""Expert parallelism over device meshes: flat and 2DH all_to_all, the shard_map'd layer, placement helpers.

`tutel_jax.parallel.failures` tells which process of a multi-process job stopped when a collective fails.
"""

from .all_to_all import expert_all_to_all, expert_all_to_all_reverse
from .expert_parallel import ExpertParallel, moe_apply_parallel, param_shardings, shard_map, shard_params
from .expert_sliced import moe_apply_expert_sliced

__all__ = ["ExpertParallel", "moe_apply_parallel", "param_shardings", "shard_params", "shard_map", "expert_all_to_all",
           "expert_all_to_all_reverse", "moe_apply_expert_sliced"]
