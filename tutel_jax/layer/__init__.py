"""The MoE layer: its static description (`config`: `make_config` -> `MoEConfig`), the one data flow every layout
plugs into (`pipeline`: `init_params`, `moe_apply`, `moe_pipeline`), the capacity and dropless expert paths
(`expert_paths`) and the record of how it runs (`execution`)."""

from ._config import MoEConfig, make_config, valid_adaptive_degrees
from ._execution import Execution
from ._pipeline import MoEAux, init_params, moe_apply, moe_pipeline, route, empty_result, routing_args
from ._expert_paths import run_routed_experts

from . import _execution as execution  # the Execution record, its resolution and CLI flags

__all__ = ["execution", "empty_result", "routing_args", "run_routed_experts", "valid_adaptive_degrees", "MoEConfig",
           "make_config", "MoEAux", "init_params", "moe_apply", "moe_pipeline", "route", "Execution"]
