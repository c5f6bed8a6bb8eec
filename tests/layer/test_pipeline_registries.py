"""The one MoE pipeline and its registries: a dropless path registered by name runs through `moe_apply` and
`make_config`, the dropless exchanges resolve by name with their documented fallback, and the expert-parallel
layer is the same pipeline with another runner (no routing or expert code of its own)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.experts import _dropless as dropless
from tutel_jax import make_config
from tutel_jax.core import DROPLESS_EXCHANGES, CallOptions, LOCAL, TokenGroup
from tutel_jax.layer import init_params, moe_apply, moe_pipeline
from tutel_jax.parallel import _exchanges as exchanges, _expert_parallel as expert_parallel

M, H = 16, 24


def _layer(impl: str = "ragged"):
    config = make_config({"type": "top", "k": 2, "capacity_factor": 0.0}, M,
                         {"type": "swiglu", "count_per_node": 4, "hidden_size_per_expert": H}, dropless_impl=impl)
    return config, init_params(config, jax.random.key(0))


def test_a_registered_dropless_path_is_selected_by_name():
    calls = []

    def doubled_ragged(expert_params, x, plan, config, spread):
        calls.append(spread)
        return 2.0 * dropless.DROPLESS_PATHS["ragged"].run(expert_params, x, plan, config, spread)

    dropless.register_dropless_path(dropless.DroplessPath("test_doubled", doubled_ragged))
    try:
        assert "test_doubled" in dropless.impl_names()
        config, params = _layer("test_doubled")
        x = jax.random.normal(jax.random.key(1), (12, M))
        y, _ = moe_apply(params, x, config)
        ref, _ = moe_apply(params, x, _layer("ragged")[0])
        np.testing.assert_array_equal(np.asarray(y), 2.0 * np.asarray(ref))
        assert calls == [4]  # the experts the assignments spread over
    finally:
        del dropless.DROPLESS_PATHS["test_doubled"]
    with pytest.raises(ValueError, match="dropless_impl must be one of"):
        _layer("test_doubled")


class _BatchedOnly:
    """Experts written against the minimal protocol: init and batched."""

    def init(self, key, model_dim, num_experts, dtype):
        return {"w": jax.random.normal(key, (num_experts, model_dim, model_dim), dtype)}

    def batched(self, params, x):
        return jnp.einsum("ecm,emn->ecn", x, params["w"])


def test_a_path_that_needs_an_expert_method_is_refused_without_it():
    with pytest.raises(ValueError, match=r"dropless_impl='gather' needs experts with a gathered\(\) method"):
        make_config({"type": "top", "k": 2}, M, _BatchedOnly(), dropless_impl="gather")


def test_exchanges_resolve_by_name_with_the_padded_fallback():
    assert set(exchanges.EXCHANGES) | {"auto"} == set(DROPLESS_EXCHANGES)
    assert exchanges.resolve_exchange("padded", True) is None
    assert exchanges.resolve_exchange("emulated", True) is exchanges.EXCHANGES["emulated"].collective
    assert exchanges.resolve_exchange("ragged", True) is jax.lax.ragged_all_to_all
    # 'auto' on CPU: ragged_all_to_all does not compile there, so the padded exchange
    assert exchanges.resolve_exchange("auto", True) is None
    for name in DROPLESS_EXCHANGES:  # sharded experts / 2DH: always padded
        assert exchanges.resolve_exchange(name, False) is None
    with pytest.raises(ValueError, match="dropless_exchange must be one of"):
        exchanges.resolve_exchange("fast", True)


def test_moe_apply_is_the_pipeline_with_the_local_runner():
    config, params = _layer()
    x = jax.random.normal(jax.random.key(2), (3, 4, M))
    y1, aux1 = moe_apply(params, x, config, top_k=1)
    y2, aux2 = moe_pipeline(params, x, config, CallOptions(top_k=1), group=LOCAL)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    for a, b in zip(jax.tree.leaves(aux1), jax.tree.leaves(aux2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_valid_mask_on_one_device_counts_only_valid_assignments():
    """The aux of a masked call: padding tokens are not assignments (dropped fraction over the valid ones)."""
    config = make_config({"type": "top", "k": 1, "capacity_factor": 0.5}, M,
                         {"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": H})
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(3), (8, M))
    valid = jnp.arange(8) < 6
    y, aux = moe_pipeline(params, x, config, CallOptions(), valid=valid, group=TokenGroup())
    assert np.all(np.asarray(y)[6:] == 0)  # padding tokens output 0
    kept = int(np.sum(np.asarray(y)[:6].any(axis=1)))
    np.testing.assert_allclose(float(aux.dropped_fraction), (6 - kept) / 6, rtol=1e-6)


def test_expert_parallel_has_no_routing_or_expert_code_of_its_own():
    source = inspect.getsource(expert_parallel)
    for name in ("route(", "fast_encode", "fast_decode", ".batched(", "run_bucketed", "apply_shared_experts"):
        assert name not in source, name
    assert "moe_pipeline(" in source
