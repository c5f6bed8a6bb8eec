"""Training and runtime changes: switching a running layer's layout and routing (`reconfigure`, `text` for
'ep=4,dp=2' strings), the trainer (`training.MoETrainer`: step, switch, evaluate, autotune, save / restore) and
the adaptive runtime's decisions (`autotune`)."""

from ._reconfigure import RuntimeConfig, batch_shardings, reconfigure_layer
from ._text import parse_runtime
from ._autotune import Candidate, LOAD_RATIO_KEY, load_ratio
from ._training import MoETrainer

# `training.MoETrainer` is not imported here: the NNX layer builds on `reconfigure`, and `import tutel_jax`
# should not load the trainer's Orbax checkpointing

__all__ = ["Candidate", "LOAD_RATIO_KEY", "MoETrainer", "batch_shardings", "load_ratio", "reconfigure_layer",
           "RuntimeConfig", "parse_runtime"]
