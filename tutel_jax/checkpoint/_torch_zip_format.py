"""The tables the `torch.save` zip reader (`torch_zip`) and writer (`torch_zip_write`) share, and the reader's
limits on what an untrusted file may make it allocate."""

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

# Limits of the reader: a checkpoint file is untrusted input, so what it may make the reader allocate is bounded
# by what the file itself holds.
#: a compressed zip entry may expand at most this many times its compressed size (torch stores entries
#: uncompressed; a deflate bomb expands ~1000x) ...
MAX_EXPANSION_RATIO = 100
#: ... except that entries up to this size are always accepted (small runs of zeros deflate far better)
EXPANSION_FLOOR_BYTES = 1 << 20
#: the largest data.pkl read (it holds names and tensor records, not weights: a few MB for thousands of tensors)
MAX_PICKLE_BYTES = 256 << 20
#: the most items the unpickler's stack may hold at once (torch's pickler batches 1000 items per APPENDS /
#: SETITEMS), and how deeply MARKs may nest
MAX_PICKLE_STACK = 1 << 20
MAX_PICKLE_MARKS = 64
#: the deepest nesting of dicts / lists / tuples accepted in the unpickled object (a state dict nests 1-3 levels)
MAX_NESTING = 64
