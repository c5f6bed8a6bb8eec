"""Checkpoints: Tutel torch.save files (read/written without torch), per-rank files, orbax, safetensors."""

from .torch_zip import load_torch_file, save_torch_file, CheckpointFormatError, UnsafeCheckpointError
from .paths import resolve_inside
from .safetensors_io import NonFiniteTensorError
from .distributed import (gather_state_dicts, load_tutel_rank_files, load_tutel_rank_files_as_params, rank_path,
                          save_tutel_rank_files, save_tutel_state_dict_rank_files, scatter_state_dict)

__all__ = ["load_torch_file", "save_torch_file", "CheckpointFormatError", "UnsafeCheckpointError",
           "NonFiniteTensorError", "resolve_inside",
           "gather_state_dicts", "load_tutel_rank_files", "load_tutel_rank_files_as_params", "rank_path",
           "save_tutel_rank_files", "save_tutel_state_dict_rank_files", "scatter_state_dict",
           "save_checkpoint", "restore_checkpoint", "latest_step", "all_steps"]

_ORBAX_EXPORTS = ("save_checkpoint", "restore_checkpoint", "latest_step", "all_steps")


def __getattr__(name):  # Orbax is imported on first use only (keeps `python -m tutel_jax.checkpoint` quick)
    if name in _ORBAX_EXPORTS:
        from . import orbax_io
        return getattr(orbax_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
