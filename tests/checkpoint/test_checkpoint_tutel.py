"""Tutel checkpoint import/export through the layer: key mapping, round trips, clear errors, nothing half-loaded."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support.tutel_cases import TutelCase
from tutel_jax import moe
from tutel_jax.checkpoint import CheckpointFormatError, load_torch_file

CASE = TutelCase("top2_cf1")


def _layer(**overrides):
    kwargs = CASE.layer_kwargs()
    kwargs.update(overrides)
    return moe.moe_layer(**kwargs, rngs=nnx.Rngs(0))


def _snapshot(layer):
    return {k: v.copy() for k, v in layer.state_dict().items()}


def test_every_key_is_mapped():
    layer = _layer()
    layer.load_state_dict(CASE.dir / "state_dict.pt")
    state = layer.state_dict()
    expected = {p.stem for p in (CASE.dir / "params").glob("*.npy")}
    assert set(state) == expected
    for key in expected:
        want = np.load(CASE.dir / "params" / f"{key}.npy")
        assert state[key].dtype == want.dtype and state[key].shape == want.shape, key
        np.testing.assert_array_equal(state[key], want, err_msg=key)


def test_load_from_mapping_and_prefixed_model_state_dict():
    arrays = {p.stem: np.load(p) for p in (CASE.dir / "params").glob("*.npy")}
    a = _layer()
    a.load_state_dict(arrays)
    b = _layer()
    b.load_state_dict({f"_moe_layer.{k}": v for k, v in arrays.items()} | {"head.weight": np.zeros(3)})
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(v, b.state_dict()[k])
    with pytest.raises(ValueError, match="several MoE layers"):
        _layer().load_state_dict({f"l{i}.{k}": v for i in (0, 1) for k, v in arrays.items()})
    c = _layer()
    c.load_state_dict({f"l{i}.{k}": v for i in (0, 1) for k, v in arrays.items()}, prefix="l1.")


def test_export_round_trip(tmp_path):
    layer = _layer(seeds=(4, 5, 6))
    path = tmp_path / "moe.pt"
    layer.save_state_dict(path)
    raw = load_torch_file(path)
    assert raw["_num_global_experts"].dtype == np.int64 and int(raw["_num_global_experts"]) == 4
    other = _layer()
    other.load_state_dict(path)
    x = jnp.asarray(CASE.array("input"))
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(other(x)))


@pytest.mark.parametrize("mutate,match", [
    (lambda s: s.update(_num_global_experts=np.asarray(8, np.int64)), "8 global experts"),
    (lambda s: s.pop("experts.batched_fc2_bias"), r"missing key\(s\) \['experts.batched_fc2_bias'\]"),
    (lambda s: s.update({"experts.batched_fc1_w": np.zeros((4, 64, 64), np.float32)}),
     r"'experts.batched_fc1_w' has shape \[4, 64, 64\], this layer expects \[4, 128, 64\]"),
    (lambda s: s.update({"gates.1.wg.weight": np.zeros((4, 64), np.float32)}), "does not have"),
    (lambda s: s.pop("_num_global_experts"), "_num_global_experts"),
])
def test_bad_state_dicts_are_refused_and_layer_unchanged(mutate, match):
    state = {p.stem: np.load(p) for p in (CASE.dir / "params").glob("*.npy")}
    mutate(state)
    layer = _layer()
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=match):
        layer.load_state_dict(state)
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_wrong_expert_count_layer():
    layer = _layer(experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 128})
    with pytest.raises(ValueError, match="checkpoint has 4 global experts"):
        layer.load_state_dict(CASE.dir / "state_dict.pt")


def test_truncated_and_non_zip_files(tmp_path):
    data = (CASE.dir / "state_dict.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all" * 10)
    layer = _layer()
    before = _snapshot(layer)
    for path in (truncated, garbage, tmp_path / "missing.pt"):
        with pytest.raises(CheckpointFormatError, match=path.name):
            layer.load_state_dict(path)
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_bfloat16_layer_loads_float32_checkpoint():
    layer = _layer(dtype="bfloat16")
    layer.load_state_dict(CASE.dir / "state_dict.pt")
    p = layer.param_tree()
    assert p["experts"]["batched_fc1_w"].dtype == jnp.bfloat16 and p["gates"][0]["wg"]["weight"].dtype == jnp.float32
    y = layer(jnp.asarray(CASE.array("input"), jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(y, np.float32), CASE.array("output"), atol=0.1)  # bf16 weights


@pytest.mark.torch
def test_exported_file_reads_in_torch_with_tutel_keys(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch not installed: optional torch.load oracle")
    layer = _layer()
    layer.load_state_dict(CASE.dir / "state_dict.pt")
    path = tmp_path / "export.pt"
    layer.save_state_dict(path)
    loaded = torch.load(path, weights_only=True)
    original = torch.load(CASE.dir / "state_dict.pt", weights_only=True)
    assert list(loaded) == sorted(original) or set(loaded) == set(original)
    for k, v in original.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
