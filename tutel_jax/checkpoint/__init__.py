"""Checkpoints: Tutel torch.save files (read/written without torch), per-rank files, safetensors. Orbax save /
restore of sharded train states is in `tutel_jax.training` (Orbax is large)."""

from ._distributed import (gather_state_dicts, load_tutel_rank_files, load_tutel_rank_files_as_params, rank_path,
                           save_tutel_rank_files, save_tutel_state_dict_rank_files, scatter_state_dict)
from ._paths import resolve_inside
from ._safetensors_io import NonFiniteTensorError, DTYPES, DTYPE_BITS, open_checkpoint
from ._torch_zip import CheckpointFormatError, UnsafeCheckpointError, load_torch_file, save_torch_file
from ._safetensors_write import (HF_MAX_SHARD_BYTES, TensorInfo, plan_shards, shard_is_complete, write_index,
                                 write_shard)
from ._tutel_format import NUM_EXPERTS_KEY, params_to_state_dict, read_state_dict, state_dict_to_params

__all__ = ["NUM_EXPERTS_KEY", "params_to_state_dict", "read_state_dict", "state_dict_to_params", "DTYPES",
           "DTYPE_BITS", "HF_MAX_SHARD_BYTES", "TensorInfo", "open_checkpoint",
           "plan_shards", "shard_is_complete", "write_index", "write_shard",
           "load_torch_file", "save_torch_file", "CheckpointFormatError", "UnsafeCheckpointError",
           "NonFiniteTensorError", "resolve_inside", "gather_state_dicts", "load_tutel_rank_files",
           "load_tutel_rank_files_as_params", "rank_path", "save_tutel_rank_files",
           "save_tutel_state_dict_rank_files", "scatter_state_dict"]
