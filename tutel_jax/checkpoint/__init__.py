from .torch_zip import load_torch_file, save_torch_file, CheckpointFormatError, UnsafeCheckpointError
