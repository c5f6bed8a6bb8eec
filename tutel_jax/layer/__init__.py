"""The MoE layer: its static description (`config`: `make_config` -> `MoEConfig`), the one data flow every layout
plugs into (`pipeline`: `init_params`, `moe_apply`, `moe_pipeline`), the capacity and dropless expert paths
(`expert_paths`) and the record of how it runs (`execution`)."""

from .config import MoEConfig, make_config
from .execution import Execution
from .pipeline import MoEAux, init_params, moe_apply, moe_pipeline, route

__all__ = ["MoEConfig", "make_config", "MoEAux", "init_params", "moe_apply", "moe_pipeline", "route", "Execution"]
