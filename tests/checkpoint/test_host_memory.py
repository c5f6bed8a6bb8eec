"""Aligned host arrays (`host_memory`): what checkpoint reads return, and JAX:CPU adopts them without a copy;
large ones on huge pages."""

from __future__ import annotations

import re
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint._safetensors_io import SafetensorsFile
from tutel_jax.core._host_memory import (ALIGNMENT, HUGE_MIN_BYTES, HUGE_PAGE, collapse_to_huge_pages,
                                         empty_aligned)
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


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode ('always', 'madvise', 'never'), None off Linux or without THP."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return re.search(r"\[(\w+)\]", text).group(1)


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if inside:
                break
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_large_arrays_start_on_a_huge_page_and_are_adopted():
    """From HUGE_MIN_BYTES on, an array has a mapping of its own starting on a 2 MiB boundary (Linux), marked for
    transparent huge pages where the kernel has them; JAX:CPU still adopts it without a copy."""
    a = empty_aligned((HUGE_MIN_BYTES // 2 + 3,), ml_dtypes.bfloat16)
    a[...] = 2.5
    assert a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0
    x = quant_weights.to_jax(a, ml_dtypes.bfloat16)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x, np.float32), 2.5)
    if not sys.platform.startswith("linux"):
        pytest.skip("huge-page mappings are Linux only (elsewhere large arrays are 64-byte aligned, checked above)")
    assert a.ctypes.data % HUGE_PAGE == 0
    if _thp_mode() in ("always", "madvise"):
        assert _mapping_flags(a.ctypes.data + HUGE_PAGE).get("THPeligible") == "1"
    small = empty_aligned((HUGE_MIN_BYTES - 1,), np.uint8)  # malloc's arenas: 64-byte aligned only
    assert small.ctypes.data % ALIGNMENT == 0


def test_collapse_asks_for_the_whole_huge_pages_of_large_leaves_and_keeps_the_values():
    rng = np.random.default_rng(0)
    big = empty_aligned((3 * HUGE_PAGE + 1000,), np.uint8)
    big[...] = rng.integers(0, 256, big.shape, dtype=np.uint8)
    want = big.copy()
    shifted = empty_aligned((HUGE_MIN_BYTES + 4096,), np.uint8)[4096:]  # starts inside a huge page: 1 whole one
    shifted[...] = 7
    on_device = quant_weights.to_jax(big, np.uint8)  # adopted: the same memory
    tree = {"big": big, "small": np.ones(100, np.float32), "shifted": shifted, "device": [on_device], "none": None}
    asked = collapse_to_huge_pages(tree)
    if not sys.platform.startswith("linux"):
        assert asked == 0
        return
    # big: 3 whole pages (twice: the array and the device buffer over it); shifted: the 1 whole page inside it
    assert asked == 2 * 3 * HUGE_PAGE + HUGE_PAGE
    np.testing.assert_array_equal(big, want)
    np.testing.assert_array_equal(np.asarray(on_device), want)
    assert (shifted == 7).all()
