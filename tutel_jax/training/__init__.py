"""Training: `MoETrainer` (a training state that switches layout, capacity and top-k between two steps,
evaluates, autotunes, saves and restores) and Orbax checkpoints of sharded train states (`save_checkpoint` /
`restore_checkpoint`: save on one mesh, restore onto any other). Not imported by `import tutel_jax` (Orbax is
large): `from tutel_jax.training import MoETrainer`."""

from ._orbax_io import all_steps, latest_step, restore_checkpoint, save_checkpoint
from ._trainer import AutotuneReport, CacheInfo, MoECall, MoETrainer, SwitchReport, TrainState

__all__ = ["MoETrainer", "MoECall", "TrainState", "SwitchReport", "CacheInfo", "AutotuneReport", "save_checkpoint",
           "restore_checkpoint", "latest_step", "all_steps"]
