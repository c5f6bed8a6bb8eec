"""Every registered weight format's record is consistent: the quantizer makes its container, the on-disk tensors
it describes are the container's arrays, the reader finds them again under the unquantized name, and the reader's
container dequantizes bit for bit like the NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.quant import FORMATS, format_for_config, format_of
from pallas_kernels.quant.formats import TensorSite
from support.channel_checkpoint import channel_config

CODES = {"U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
         "F32": np.dtype(np.float32)}


#: the per-channel formats' compressed-tensors element (`support.channel_checkpoint.channel_config`)
CHANNEL_ELEMENTS = {"int8": "int8", "fp8_channel": "fp8"}
INT8_WEIGHTS = channel_config("int8")["config_groups"]["group_0"]["weights"]
EXPERTS, OUT, IN = 2, 48, 64


def _config(fmt) -> dict:
    q = {"quant_method": fmt.hf_methods[0]}
    if fmt.hf_formats:
        q["format"] = fmt.hf_formats[0]
    if fmt.name in CHANNEL_ELEMENTS:
        q["config_groups"] = channel_config(CHANNEL_ELEMENTS[fmt.name])["config_groups"]
    return q


def _site_and_weight(fmt, rng):
    """A tensor of the float checkpoint layout the format stores quantized, and the [.., out, in] weight."""
    if fmt.name == "mxfp4":  # fused expert weights, float layout [E, in, out]
        w = rng.standard_normal((EXPERTS, OUT, IN)).astype(np.float32)
        return TensorSite("model.layers.0.mlp.experts.down_proj", (EXPERTS, IN, OUT), linear=False,
                          fused_expert=True), w
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    return TensorSite("model.layers.0.mlp.down_proj.weight", (OUT, IN), linear=True, fused_expert=False), w


@pytest.mark.parametrize("name", list(FORMATS))
def test_format_record_round_trip(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(0)
    site, w = _site_and_weight(fmt, rng)
    q = _config(fmt)
    assert format_for_config(q) is fmt
    fmt.check_hf_config(q)

    container = fmt.quantize(jnp.asarray(w))
    assert type(container) is fmt.container and container.format == fmt.name and format_of(container) is fmt
    assert tuple(container.shape) == w.shape
    # round to nearest: every value within half a step of the largest one's grid
    err = np.abs(np.asarray(container.dequantize()) - w).max()
    assert err < 0.5 * np.abs(w).max(), err

    disk = fmt.disk_tensors(site, q)
    leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(container)]
    assert [t.shape for t in disk] == [a.shape for a in leaves]
    assert [CODES[t.dtype] for t in disk] == [a.dtype for a in leaves]
    assert all(t.role in fmt.roles and t.dtype in fmt.roles[t.role] for t in disk)
    tensors = {t.name: a for t, a in zip(disk, leaves)}

    found = [p for p in (fmt.find_parts(n, tensors) for n in tensors) if p is not None]
    assert len(found) == 1
    parts = found[0]
    assert parts.base == site.name and set(parts.names) == set(tensors)
    arrays = [tensors[n] for n in parts.names]
    read = fmt.from_parts(parts, arrays, q)
    reference = fmt.dequantize_numpy(parts, arrays, q)  # the float checkpoint's layout
    got = np.asarray(read.dequantize())
    if site.fused_expert:
        got = np.swapaxes(got, -1, -2)
    assert reference.shape == site.shape
    np.testing.assert_array_equal(got, reference)  # bit for bit

    for t in disk:
        rule = fmt.byte_nonfinite(t.name) if t.dtype == "U8" else None
        assert (rule is not None) == (t.role in ("e8m0", "e4m3_scale") and t.dtype == "U8"), (t, rule)

    native_id = fmt.native_args(jax.tree_util.tree_map(lambda a: a[None], container)
                                if not site.fused_expert else container)[0]
    assert isinstance(native_id, int) and native_id >= 2


def test_a_site_the_format_does_not_quantize_stays_float():
    for fmt in FORMATS.values():
        norm = TensorSite("model.layers.0.input_layernorm.weight", (OUT,), linear=False, fused_expert=False)
        assert fmt.disk_tensors(norm, _config(fmt)) is None


def test_reader_rejects_parts_that_do_not_fit():
    fmt = FORMATS["nvfp4"]
    names = {"x.weight_packed": np.zeros((4, 8), np.uint8), "x.weight_scale": np.zeros((4, 3), ml_dtypes.float8_e4m3fn),
             "x.weight_global_scale": np.ones((1,), np.float32)}
    parts = fmt.find_parts("x.weight_packed", names)
    with pytest.raises(ValueError, match=r"weight_scale shape \(4, 3\) does not fit weight_packed \(4, 8\)"):
        fmt.from_parts(parts, [names[n] for n in parts.names], {})
    with pytest.raises(ValueError, match="lacks"):
        fmt.find_parts("y.weight_packed", {"y.weight_packed": None})


def test_compressed_tensors_format_picks_the_format():
    ct = "compressed-tensors"
    assert format_for_config({"quant_method": ct, "format": "int-quantized"}) is FORMATS["int8"]
    assert format_for_config({"quant_method": ct, "format": "float-quantized"}) is FORMATS["fp8_channel"]
    assert format_for_config({"quant_method": ct, "format": "nvfp4-pack-quantized"}) is FORMATS["nvfp4"]
    assert format_for_config({"quant_method": ct}) is FORMATS["nvfp4"]  # no `format`: NVFP4, as before int8
    assert format_for_config({"quant_method": "fp8", "format": "int-quantized"}) is FORMATS["fp8_block"]
    assert format_for_config({"quant_method": "awq"}) is None
    for bad in ("pack-quantized", "naive-quantized", 8):
        with pytest.raises(ValueError, match=r"quantization_config.format: unsupported compressed-tensors format "
                                             r".*supported: float-quantized, int-quantized, nvfp4-pack-quantized"):
            format_for_config({"quant_method": ct, "format": bad})


@pytest.mark.parametrize("change, message", [
    ({"format": "naive-quantized"}, r"format: expected 'int-quantized', got 'naive-quantized'"),
    ({"config_groups": {}}, "config_groups: expected an object of one or more groups"),
    ({"config_groups": {"g": {"weights": None}}}, r"config_groups.g.weights: expected an object"),
    ({"config_groups": {"g": {"weights": {**INT8_WEIGHTS, "num_bits": 4}}}},
     r"config_groups.g.weights.num_bits: expected 8, got 4"),
    ({"config_groups": {"g": {"weights": {**INT8_WEIGHTS, "type": "float"}}}},
     r"config_groups.g.weights.type: expected 'int', got 'float'"),
    ({"config_groups": {"g": {"weights": {**INT8_WEIGHTS, "strategy": "group"}}}},
     r"config_groups.g.weights.strategy: expected one of \('channel', 'tensor'\), got 'group'"),
    ({"config_groups": {"g": {"weights": {**INT8_WEIGHTS, "symmetric": False}}}},
     r"config_groups.g.weights.symmetric: expected True, got False"),
    ({"config_groups": {"g": {"weights": INT8_WEIGHTS,
                              "input_activations": {"num_bits": 8, "dynamic": False}}}},
     r"config_groups.g.input_activations: expected null or dynamic quantization"),
])
def test_channel_config_names_the_key_it_cannot_read(change, message):
    q = {**_config(FORMATS["int8"]), **change}
    with pytest.raises(ValueError, match=message):
        FORMATS["int8"].check_hf_config(q)


def test_int8_reader_rejects_what_it_cannot_read():
    fmt = FORMATS["int8"]
    w = np.zeros((4, 8), np.int8)
    names = {"x.weight": w, "x.weight_scale": np.ones((4, 1), np.float32)}
    parts = fmt.find_parts("x.weight_scale", names)
    assert parts.names == ("x.weight", "x.weight_scale") and parts.hidden == ("x.weight_scale",)
    # NVFP4's `weight_scale` (compressed-tensors and ModelOpt) is not an int8 scale; a scale without weight neither
    assert fmt.find_parts("x.weight_scale", {**names, "x.weight_packed": None}) is None
    assert fmt.find_parts("x.weight_scale", {**names, "x.weight_scale_2": None}) is None
    assert fmt.find_parts("y.weight_scale", {"y.weight_scale": None}) is None
    with pytest.raises(ValueError, match=r"weight_scale shape \(4,\) does not fit weight \(4, 8\)"):
        fmt.from_parts(parts, [w, np.ones((4,), np.float32)], {})
    with pytest.raises(ValueError, match="int8 weight must be int8, got float8_e4m3fn"):
        fmt.from_parts(parts, [w.astype(ml_dtypes.float8_e4m3fn), names["x.weight_scale"]], {})
    zero = {**names, "x.weight_zero_point": np.zeros((4, 1), np.int8)}
    parts = fmt.find_parts("x.weight_scale", zero)
    with pytest.raises(ValueError, match="int8 weight_zero_point: asymmetric weights are not supported"):
        fmt.from_parts(parts, [zero[n] for n in parts.names], {})


def test_per_tensor_scale_reads_as_the_same_scale_per_channel():
    """compressed-tensors' strategy 'tensor' (one scale, e.g. FP8 static checkpoints): the layout stores [1], the
    reader gives every channel that scale, and the values equal the NumPy reference's."""
    fmt = FORMATS["fp8_channel"]
    q = {**_config(fmt), "config_groups": channel_config("fp8", "tensor")["config_groups"]}
    fmt.check_hf_config(q)
    site = TensorSite("x.weight", (OUT, IN), linear=True, fused_expert=False)
    assert [t.shape for t in fmt.disk_tensors(site, q)] == [(OUT, IN), (1,)]
    codes = np.random.default_rng(1).normal(size=(OUT, IN)).astype(ml_dtypes.float8_e4m3fn)
    arrays = [codes, np.full((1,), 0.25, ml_dtypes.bfloat16)]
    parts = fmt.find_parts("x.weight_scale", {"x.weight": 0, "x.weight_scale": 0})
    read = fmt.from_parts(parts, arrays, q)
    assert read.scale.shape == (OUT, 1) and read.scale.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(read.dequantize()), codes.astype(np.float32) * 0.25)
    np.testing.assert_array_equal(fmt.dequantize_numpy(parts, arrays, q), codes.astype(np.float32) * 0.25)
