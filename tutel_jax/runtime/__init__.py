"""Training and runtime changes: switching a running layer's layout and routing (`reconfigure`, `text` for
'ep=4,dp=2' strings), the trainer (`training`: step, switch, evaluate, autotune, save / restore) and the adaptive
runtime's decisions (`autotune`)."""

from .reconfigure import RuntimeConfig
from .text import parse_runtime
from .training import MoETrainer

__all__ = ["RuntimeConfig", "MoETrainer", "parse_runtime"]
