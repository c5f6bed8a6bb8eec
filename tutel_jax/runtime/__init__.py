"""Runtime changes of a running layer: switching its layout and routing (`reconfigure`: RuntimeConfig, layouts,
reshards; `text` for 'ep=4,dp=2' strings) and the adaptive runtime's decisions (`autotune`). The trainer that
uses them is `tutel_jax.training`."""

from ._autotune import (LOAD_RATIO_KEY, Autotuner, Candidate, Decision, DecisionLog, Measurement, Sample, load_ratio,
                        metrics_load_ratio)
from ._reconfigure import (Layout, RuntimeConfig, batch_shardings, opt_state_shardings, params_shardings, plan_layout,
                           reconfigure_layer, reshard)
from ._text import parse_runtime

__all__ = ["LOAD_RATIO_KEY", "Autotuner", "Candidate", "Decision", "DecisionLog", "Measurement", "Sample", "load_ratio",
           "metrics_load_ratio", "Layout", "RuntimeConfig", "batch_shardings", "opt_state_shardings",
           "params_shardings", "plan_layout", "reconfigure_layer", "reshard", "parse_runtime"]
