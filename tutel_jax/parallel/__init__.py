"""Expert parallelism over device meshes: flat and 2DH all_to_all, the shard_map'd layer, placement helpers.

`tutel_jax.parallel._failures` tells which process of a multi-process job stopped when a collective fails.
"""

from ._all_to_all import expert_all_to_all, expert_all_to_all_reverse
from ._expert_parallel import ExpertParallel, moe_apply_parallel, param_shardings, shard_map, shard_params
from ._expert_sliced import moe_apply_expert_sliced
from ._failures import (PEER_STOPPED_EXIT_CODE, current_coordinator_address, dead_peers, find_stopped_processes,
                        stopped_message)
from ._local_launch import dump_stacks_on_signal, free_port, run_processes
from ._ragged_dropless import ragged_supported

__all__ = ["PEER_STOPPED_EXIT_CODE", "current_coordinator_address", "dead_peers", "dump_stacks_on_signal",
           "find_stopped_processes", "free_port", "ragged_supported", "run_processes", "stopped_message",
           "ExpertParallel", "moe_apply_parallel", "param_shardings", "shard_params", "shard_map",
           "expert_all_to_all", "expert_all_to_all_reverse", "moe_apply_expert_sliced"]
