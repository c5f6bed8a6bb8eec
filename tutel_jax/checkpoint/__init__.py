"""Checkpoints: Tutel torch.save files (read/written without torch), per-rank files, safetensors; orbax
save / restore of sharded train states in `orbax_io` (imported on its own: Orbax is large)."""

from .distributed import (gather_state_dicts, load_tutel_rank_files, load_tutel_rank_files_as_params, rank_path,
                          save_tutel_rank_files, save_tutel_state_dict_rank_files, scatter_state_dict)
from .paths import resolve_inside
from .safetensors_io import NonFiniteTensorError
from .torch_zip import CheckpointFormatError, UnsafeCheckpointError, load_torch_file, save_torch_file

__all__ = ["load_torch_file", "save_torch_file", "CheckpointFormatError", "UnsafeCheckpointError",
           "NonFiniteTensorError", "resolve_inside",
           "gather_state_dicts", "load_tutel_rank_files", "load_tutel_rank_files_as_params", "rank_path",
           "save_tutel_rank_files", "save_tutel_state_dict_rank_files", "scatter_state_dict"]
