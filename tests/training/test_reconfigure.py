"""Runtime reconfiguration on 8 fake CPU devices (`tutel_jax.runtime._reconfigure`, `tutel_jax.training._trainer.MoETrainer`,
`MoE.reconfigure`).

Model: x @ proj -> MoE (top-2 gate with noise, E = 4 ffn experts) -> mean squared error to tanh(x), adam. Every
device routes 16 tokens, so the capacity (k * int(cf * ceil(16 / 4)) = 8) is a multiple of every s * d used here
and the layout-only switches are exactly the same math (see tutel_jax/runtime/_reconfigure.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from tutel_jax import make_config
from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params
from tutel_jax.runtime._reconfigure import RuntimeConfig, plan_layout
from tutel_jax.training import MoETrainer
from support.trainer_problem import M, batch, loss_fn, problem_params as _params
from support.paths import REPO, TESTS

H, E = 16, 4
LR = 1e-2
A = RuntimeConfig.ep(8)  # 8 devices share 4 experts: s = 2, r = 1
LAYOUTS = [  # layout-only switches from A, and back
    RuntimeConfig.ep(8, adaptive_r=2),                            # tensor parallel inside each expert
    RuntimeConfig.ep(4, data=2, a2a_ffn_overlap_degree=2),        # EP 4 x DP 2, one expert per device, d = 2
    RuntimeConfig.ep_2dh(2, 2, data=2),                           # 2DH all_to_all over (node, local)
    RuntimeConfig.ep(2, data=4, adaptive_r=0),                    # EP 2 x DP 4, r = 0 (no all_to_all)
    A,
]


def _config(gate_noise: float = 1.0):
    return make_config({"type": "top", "k": 2, "capacity_factor": 1.0, "gate_noise": gate_noise}, M,
                       {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H})




def make_trainer(runtime=A, gate_noise: float = 1.0) -> MoETrainer:
    config = _config(gate_noise)
    return MoETrainer(config, loss_fn, optax.adam(LR), _params(config), runtime, seed=7)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_bitwise(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_layout_switches_keep_state_bitwise_and_the_loss_trajectory_and_reuse_compiled_steps():
    trainer = make_trainer()
    start = _host(trainer.state)
    losses = [float(trainer.step(batch(0))["loss"])]
    for i, runtime in enumerate(LAYOUTS, start=1):
        before = _host(trainer.state)
        report = trainer.switch(runtime)
        assert report.current == trainer.runtime and trainer.runtime.mesh_shape == runtime.mesh_shape
        _assert_bitwise(trainer.state, before)  # nothing lost or changed, only placement
        fc1 = trainer.state.params["moe"]["experts"]["batched_fc1_w"]
        mu = trainer.state.opt_state[0].mu["moe"]["experts"]["batched_fc1_w"]
        assert fc1.shape == mu.shape == (E, H, M)  # global shapes kept
        assert mu.sharding == fc1.sharding  # adam's moments follow the parameters
        W = runtime.expert_world_size
        local = {s.data.shape for s in fc1.addressable_shards}
        assert local == ({(E // W, H, M)} if W <= E else {(1, H * E // W, M)}), (runtime, local)
        losses.append(float(trainer.step(batch(i))["loss"]))
    info = trainer.cache_info()
    assert trainer.compile_count == info.traces == len(set(LAYOUTS)) == 5  # switching back to A: no compile
    assert info.hits == 1 and info.entries == 5

    # the same steps without switching, from the same state, on A (cached: no compilation)
    trainer.set_state(start)
    reference = [float(trainer.step(batch(i))["loss"]) for i in range(len(LAYOUTS) + 1)]
    assert trainer.compile_count == 5 and trainer.cache_info().traces == 5
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]


def _reference_losses(schedule, gate_noise=1.0):
    """A fresh run written without the trainer: one jitted step per (k, cf), on the EP-8 layout."""
    config = _config(gate_noise)
    placement = ExpertParallel(Mesh(np.array(jax.devices()[:8]), ("expert",)))
    layer_config = plan_layout(config, A).config
    params = {"proj": _params(config)["proj"], "moe": shard_params(_params(config)["moe"], placement, layer_config)}
    optimizer = optax.adam(LR)
    opt_state = optimizer.init(params)

    @jax.jit(static_argnames=("k", "cf"))
    def step(params, opt_state, b, i, k, cf):
        rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), i), 0)

        def objective(p):
            y, aux = moe_apply_parallel(p["moe"], b["x"] @ p["proj"], layer_config, placement, top_k=k,
                                        capacity_factor=cf, rng=rng, deterministic=False)
            return jnp.mean((y - b["t"]) ** 2) + 0.01 * aux.l_aux
        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i, (k, cf) in enumerate(schedule):
        params, opt_state, loss = step(params, opt_state, batch(i), jnp.int32(i), k=k, cf=cf)
        losses.append(float(loss))
    return losses


def test_semantic_switches_match_a_fresh_run_with_the_same_schedule():
    schedule = [(2, 1.0), (2, 1.0), (1, 0.5), (1, 0.5), (2, 1.0)]
    trainer = make_trainer()
    losses, dropped = [], []
    for i, (k, cf) in enumerate(schedule):
        trainer.switch(A.replace(top_k=k, capacity_factor=cf))
        metrics = trainer.step(batch(i))
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics["dropped"]))
    assert trainer.compile_count == 2  # (2, 1.0) is compiled once and reused
    assert dropped[2] > dropped[0]  # top-1 with cf = 0.5 drops more: the switch took effect
    np.testing.assert_allclose(losses, _reference_losses(schedule), rtol=1e-5, atol=1e-6)


RESUME = textwrap.dedent("""
    import json, sys
    sys.path[:0] = {tests!r}
    from test_reconfigure import batch, make_trainer, RuntimeConfig
    trainer = make_trainer(RuntimeConfig.ep(4, data=2))
    step = trainer.restore({ckpt!r})
    losses = [float(trainer.step(batch(step + i))["loss"]) for i in range(2)]
    print("RESULT " + json.dumps({{"step": step, "losses": losses}}))
""")


def test_switch_then_checkpoint_then_restore_in_a_new_process_continues_identically(tmp_path: Path):
    trainer = make_trainer()
    trainer.step(batch(0))
    trainer.switch(RuntimeConfig.ep(4, data=2))  # mid-run switch, then one step on the new layout
    trainer.step(batch(1))
    trainer.save(tmp_path / "ckpt")
    saved = _host(trainer.state)
    expected = [float(trainer.step(batch(2 + i))["loss"]) for i in range(2)]
    other = make_trainer(RuntimeConfig.ep(2, data=4))  # any layout can restore it (no compilation needed)
    assert other.restore(tmp_path / "ckpt") == 2
    _assert_bitwise(other.state, saved)
    assert {s.data.shape for s in other.state.opt_state[0].nu["moe"]["experts"]["batched_fc2_w"].addressable_shards} \
        == {(2, H, M)}

    env = dict(os.environ, JAX_PLATFORMS="cpu")  # this process's XLA flags (conftest): the same program
    code = RESUME.format(tests=[str(Path(__file__).parent), str(TESTS)], ckpt=str(tmp_path / "ckpt"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["step"] == 2
    np.testing.assert_array_equal(result["losses"], expected)  # same program, same state: bit for bit


def test_bad_requests_are_refused_and_leave_the_running_state_untouched():
    trainer = make_trainer()
    trainer.step(batch(0))
    state, runtime = trainer.state, trainer.runtime
    leaves = jax.tree.leaves(state)
    host = _host(state)
    bad = {
        "adaptive_r must be one of \\[0, 1, 2\\]": A.replace(adaptive_r=3),           # s = 2 devices per expert
        "adaptive_r must be one of \\[0, 1\\]": RuntimeConfig.ep(4, data=2, adaptive_r=2),
        "expert-axis size 3 must divide the number of experts E=4": RuntimeConfig.ep(3),
        "expert-axis size 6 must divide": RuntimeConfig.ep(6),
        "top_k=5 exceeds the number of experts E=4": A.replace(top_k=5),
        "needs 16 devices, only 8": RuntimeConfig.ep(16),
        "use_2dh is not available when several devices share an expert": RuntimeConfig.ep_2dh(2, 4),
        "leading dimension 16 is not divisible by its 6 token shards": RuntimeConfig.ep(2, data=3),
    }
    for message, request in bad.items():
        with pytest.raises(ValueError, match=message):
            trainer.switch(request)
        assert trainer.runtime == runtime and trainer.state is state
        assert all(a is b for a, b in zip(jax.tree.leaves(trainer.state), leaves))
    _assert_bitwise(trainer.state, host)
    for message, fields in {
        "use_2dh needs two expert axes": dict(use_2dh=True),
        "top_k must be an integer >= 1": dict(top_k=0),
        "a2a_ffn_overlap_degree must be an integer >= 1": dict(a2a_ffn_overlap_degree=0),
        "capacity_factor must be a finite number": dict(capacity_factor=float("nan")),
    }.items():
        with pytest.raises(ValueError, match=message):
            A.replace(**fields)
    with pytest.raises(ValueError, match="consecutive mesh axes"):
        RuntimeConfig((("node", 2), ("data", 2), ("local", 2)), expert_axes=("node", "local"))
    trainer.step(batch(1))  # still runs, on the compiled step it had
    assert trainer.compile_count == 1


def test_helloworld_switch_example_cycles_and_reuses_compiled_steps(capsys):
    import importlib.util
    path = REPO / "examples" / "helloworld_switch.py"
    spec = importlib.util.spec_from_file_location("helloworld_switch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.parse_runtime("node=2,local=2,dp=2,d=2") == RuntimeConfig.ep_2dh(2, 2, data=2,
                                                                                     a2a_ffn_overlap_degree=2)
    with pytest.raises(ValueError, match="bad runtime item"):
        example.parse_runtime("ep=4,zz=1")
    argv = ["--batch_size", "1", "--num_tokens", "8", "--model_dim", "16", "--hidden_size", "16",
            "--steps_per_config", "2", "--schedule", "ep=8; ep=2,dp=4,k=1; ep=3; ep=8"]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    switches = [line for line in out.splitlines() if line.startswith("[Switch]")]
    assert len(switches) == 4 and "refused" in switches[2] and "E=4" in switches[2]
    assert "(new)" in switches[0] and "(new)" in switches[1] and "compile = 0.00 s (cached)" in switches[3]
    assert len([line for line in out.splitlines() if line.startswith("STEP-")]) == 6
    assert "[Cache] compiles = 2," in out


def test_nnx_module_reconfigure_moves_params_and_optimizer_and_keeps_training():
    from flax import nnx

    from tutel_jax import MoE
    traces = []

    def make():
        layer = MoE(gate_type={"type": "top", "k": 2}, model_dim=M,
                    experts={"type": "ffn", "count_per_node": 1, "hidden_size_per_expert": H}, seeds=(1, 2, 3),
                    group=ExpertParallel(Mesh(np.array(jax.devices()[:8]), ("expert",))))
        layer.eval()
        return layer, nnx.Optimizer(layer, optax.adam(LR), wrt=nnx.Param)

    x = batch(0)["x"]

    @nnx.jit
    def step(model, opt):
        traces.append(1)

        def objective(model):
            return jnp.mean((model(x) - jnp.tanh(x)) ** 2) + 0.01 * model.l_aux
        loss, grads = nnx.value_and_grad(objective)(model)
        opt.update(model, grads)
        return loss

    layer, opt = make()
    losses = [float(step(layer, opt)), float(step(layer, opt))]  # the 2nd call sees the shardings steps return
    compiled_on_a = len(traces)
    before = _host(nnx.state(opt))
    layer.reconfigure(RuntimeConfig.ep(4, data=2, a2a_ffn_overlap_degree=2), optimizer=opt)
    _assert_bitwise(nnx.state(opt), before)
    assert layer.placement.world_size == 4 and layer.config.num_local_experts == 2
    mu = opt.opt_state[0].mu["params"]["experts"]["batched_fc1_w"].get_value()
    assert mu.sharding == layer.param_tree()["experts"]["batched_fc1_w"].sharding
    assert {s.data.shape for s in mu.addressable_shards} == {(2, H, M)}
    losses.append(float(step(layer, opt)))
    assert len(traces) == compiled_on_a + 1
    layer.reconfigure(RuntimeConfig((("expert", 8),)), optimizer=opt)  # the original mesh again
    losses.append(float(step(layer, opt)))
    assert len(traces) == compiled_on_a + 1  # nnx.jit reuses the compilation for the first layout
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        layer.reconfigure(RuntimeConfig.ep(8, top_k=9), optimizer=opt)
    assert layer.placement.world_size == 8

    other, other_opt = make()
    reference = [float(step(other, other_opt)) for _ in range(4)]
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=1e-6)
