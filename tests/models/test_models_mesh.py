"""`from_pretrained(path, mesh=...)`: routed experts split over the mesh's expert axis while the checkpoint is
read (each device holds only its experts), other weights replicated; the sharded model's logits and greedy
tokens equal the single-device model's (float32: 1e-5 relative)."""

from __future__ import annotations


import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from tutel_jax.models import from_pretrained
from tutel_jax.serving import generate
from support.paths import HF
from support.exact_paths import FLOAT_ACTIVATIONS



def _expert_leaves(model):
    return [leaf for layer in model.params["layers"] if "moe" in layer
            for leaf in jax.tree_util.tree_leaves(layer["moe"]["experts"])]


@pytest.mark.parametrize("case,shape", [("qwen3_moe", (8,)), ("deepseek_v3", (2, 4)), ("qwen3_moe_nvfp4", (2, 4)),
                                        ("gpt_oss_mxfp4", (8,))])
def test_experts_are_placed_shard_by_shard(case, shape):
    devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    axes = ("expert",) if len(shape) == 1 else ("data", "expert")
    mesh = Mesh(devices, axes)
    n = mesh.shape["expert"]
    model = from_pretrained(HF / case, mesh=mesh, **FLOAT_ACTIVATIONS)  # the 1e-5 comparison below
    leaves = _expert_leaves(model)
    assert leaves
    for leaf in leaves:  # every device holds E / n experts of every expert tensor, none holds them all
        assert leaf.sharding.spec[0] == "expert"
        shards = leaf.addressable_shards
        assert len(shards) == devices.size
        assert {s.data.shape[0] for s in shards} == {leaf.shape[0] // n}
    embed = model.params["embed"]
    assert embed.sharding.is_fully_replicated and len(embed.addressable_shards) == devices.size

    single = from_pretrained(HF / case, **FLOAT_ACTIVATIONS)
    e = np.load(HF / case / "expected.npz")
    got, ref = np.asarray(model(e["input_ids"])), np.asarray(single(e["input_ids"]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    out = generate(model, e["input_ids"], 4)
    np.testing.assert_array_equal(out.tokens, e["greedy"][:, e["input_ids"].shape[1]:][:, :4])


def test_expert_count_must_divide_the_axis():
    mesh = Mesh(np.array(jax.devices()[:3]), ("expert",))
    with pytest.raises(ValueError, match="8 experts cannot be split over mesh axis 'expert' of size 3"):
        from_pretrained(HF / "mixtral", mesh=mesh)
    with pytest.raises(ValueError, match="expert_axis 'ep' is not an axis"):
        from_pretrained(HF / "mixtral", mesh=mesh, expert_axis="ep")


def test_sharded_forward_never_gathers_expert_weights():
    """The partitioned program computes each device's experts on the tokens and all-reduces activations; no
    float tensor (expert weights included) is all-gathered."""
    import jax.numpy as jnp

    from tutel_jax.models import context_from_mask

    mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
    model = from_pretrained(HF / "qwen3_moe", mesh=mesh)
    ids = jnp.ones((2, 12), jnp.int32)
    hlo = model._fwd.lower(model.params, ids, context_from_mask(jnp.ones(ids.shape, bool))).compile().as_text()
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line or "all-gather-start(" in line]
    assert not [line for line in gathers if "f32[" in line or "bf16[" in line], gathers
    assert any(" all-reduce(" in line and "f32[" in line for line in hlo.splitlines())
