"""`tutel-jax compile`: does a model fit an accelerator, and how fast can it go, answered on a CPU host by
compiling the project's own programs for the target without its devices (jax >= 0.12).

Modules: `hardware` (the targets' published figures), `topology` (target spelling -> deviceless topology),
`weights` (the loader's parameter tree as abstract, sharded values), `programs` (prefill / decode / train
steps as per-layer programs), `roofline` (the analytic FLOPs / HBM bytes of a step and its time floor),
`report` (what XLA says about a compiled program; the table), `driver` (mesh, compile, totals), `cli`
(arguments and exit codes).
"""

from ._hardware import HARDWARE, Hardware
from ._topology import DevicelessUnavailable, Target, TargetError, parse_target
from ._driver import compile_model
from ._cli import main

__all__ = ["main", "compile_model", "HARDWARE", "Hardware", "Target", "TargetError", "DevicelessUnavailable", "parse_target"]
