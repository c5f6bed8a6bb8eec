"""The tables the `torch.save` zip reader (`torch_zip`) and writer (`torch_zip_write`) share."""

from __future__ import annotations

import ml_dtypes
import numpy as np

# torch's typed storage class names <-> numpy dtypes. torch pickles the storage
# type as a global such as ``torch.FloatStorage`` inside each persistent id.
_STORAGE_DTYPES: dict[str, np.dtype] = {
    "FloatStorage": np.dtype(np.float32),
    "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}

# torch aligns every record's data to this many bytes (``.storage_alignment``).
_ALIGNMENT = 64
# Version of the zip layout torch >= 1.10 writes (``<top>/version``).
_ARCHIVE_VERSION = b"3\n"
# Items per MARK ... SETITEMS batch, as the stdlib pickler does.
_SETITEMS_BATCH = 1000
