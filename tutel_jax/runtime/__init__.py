"""Training and runtime changes: switching a running layer's layout and routing (`reconfigure`, `text` for
'ep=4,dp=2' strings), the trainer (`training.MoETrainer`: step, switch, evaluate, autotune, save / restore) and
the adaptive runtime's decisions (`autotune`)."""

from .reconfigure import RuntimeConfig
from .text import parse_runtime

# `training.MoETrainer` is not imported here: the NNX layer builds on `reconfigure`, and `import tutel_jax`
# should not load the trainer's Orbax checkpointing
__all__ = ["RuntimeConfig", "parse_runtime"]
