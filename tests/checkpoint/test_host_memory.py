"""Aligned host arrays (`host_memory`): what checkpoint reads return, and JAX:CPU adopts them without a copy."""

from __future__ import annotations

import re

import jax
import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint._safetensors_io import SafetensorsFile
from tutel_jax.core._host_memory import ALIGNMENT, empty_aligned
from tutel_jax.quant import _weights as quant_weights


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), (7, ml_dtypes.bfloat16), ((0, 4), np.uint8),
                                         ((2, 3, 9), ml_dtypes.float8_e4m3fn)])
def test_empty_aligned_is_aligned_and_contiguous(shape, dtype):
    for _ in range(4):  # whatever offset malloc returns
        a = empty_aligned(shape, dtype)
        assert a.shape == ((shape,) if isinstance(shape, int) else shape) and a.dtype == np.dtype(dtype)
        assert a.flags.c_contiguous and (a.size == 0 or a.ctypes.data % ALIGNMENT == 0)


def test_stack_reads_lazily_and_equals_np_stack():
    xs = [np.arange(12, dtype=np.int32).reshape(3, 4) * i for i in range(5)]
    taken = []

    def lazily():
        for x in xs:
            taken.append(len(taken))
            yield x

    out = quant_weights.stack(lazily(), len(xs))
    np.testing.assert_array_equal(out, np.stack(xs))
    assert out.ctypes.data % ALIGNMENT == 0 and taken == [0, 1, 2, 3, 4]


def test_stack_of_containers_is_field_by_field():
    rng = np.random.default_rng(0)
    ws = [quant_weights.quantize(rng.standard_normal((64, 64)).astype(np.float32), "mxfp4") for _ in range(3)]
    host = [jax.tree_util.tree_map(np.asarray, w) for w in ws]
    out = quant_weights.stack(iter(host), 3)
    assert out.format == "mxfp4"
    for field_out, *fields in zip(jax.tree_util.tree_leaves(out), *(jax.tree_util.tree_leaves(h) for h in host)):
        np.testing.assert_array_equal(field_out, np.stack(fields))


@pytest.mark.parametrize("values, count, message", [
    ([np.zeros((2, 3), np.float32)] * 2, 3, "2 experts, expected 3"),
    ([np.zeros((2, 3), np.float32)] * 3, 2, "more than 2 experts"),
    ([np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)], 2, "expert 1 has shape [3, 2] (float32)"),
    ([np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float16)], 2, "expert 1 has shape [2, 3] (float16)"),
])
def test_stack_bad_experts_name_the_expert(values, count, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        quant_weights.stack(values, count, what="w")


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
