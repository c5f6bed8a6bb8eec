"""Aligned host arrays (`host_memory`): what checkpoint reads return, and JAX:CPU adopts them without a copy."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint.safetensors_io import SafetensorsFile
from tutel_jax.host_memory import ALIGNMENT, empty_aligned, stack_aligned
from tutel_jax import quant_weights


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), (7, ml_dtypes.bfloat16), ((0, 4), np.uint8),
                                         ((2, 3, 9), ml_dtypes.float8_e4m3fn)])
def test_empty_aligned_is_aligned_and_contiguous(shape, dtype):
    for _ in range(4):  # whatever offset malloc returns
        a = empty_aligned(shape, dtype)
        assert a.shape == ((shape,) if isinstance(shape, int) else shape) and a.dtype == np.dtype(dtype)
        assert a.flags.c_contiguous and (a.size == 0 or a.ctypes.data % ALIGNMENT == 0)


def test_stack_aligned_equals_np_stack():
    xs = [np.arange(12, dtype=np.int32).reshape(3, 4) * i for i in range(5)]
    out = stack_aligned(xs)
    np.testing.assert_array_equal(out, np.stack(xs))
    assert out.ctypes.data % ALIGNMENT == 0


def test_cpu_device_put_adopts_an_aligned_array():
    a = empty_aligned((1024, 256), ml_dtypes.bfloat16)
    a[...] = 1.5
    x = quant_weights.to_jax(a, ml_dtypes.bfloat16)
    assert x.unsafe_buffer_pointer() == a.ctypes.data  # the same memory: the weight is held once
    np.testing.assert_array_equal(np.asarray(x, np.float32), 1.5)
    y = quant_weights.to_jax(a, np.float32)  # a cast makes a new array
    assert y.dtype == np.float32 and y.unsafe_buffer_pointer() != a.ctypes.data


@pytest.mark.parametrize("check_finite", [False, True])
def test_safetensors_reads_are_aligned(tmp_path, check_finite):
    from safetensors.numpy import save_file
    tensors = {"a": np.arange(33, dtype=np.float32), "b": np.ones((3, 7), np.float16), "c": np.arange(5, dtype=np.uint8)}
    save_file(tensors, tmp_path / "x.safetensors")
    with SafetensorsFile(tmp_path / "x.safetensors", check_finite=check_finite) as f:
        for name, want in tensors.items():
            got = f[name]
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype and got.ctypes.data % ALIGNMENT == 0
