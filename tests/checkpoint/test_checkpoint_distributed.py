"""Tutel per-rank checkpoints (gather / scatter, files, CLI) and Orbax training-state checkpoints: restore of an
8-device expert-parallel state onto 8, 4 and 1 devices, and atomicity under SIGKILL."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from support.tutel_cases import TutelCase
from tutel_jax import init_params, make_config, moe_apply
from tutel_jax.checkpoint import (load_torch_file, gather_state_dicts, load_tutel_rank_files,
                                  load_tutel_rank_files_as_params, rank_path, save_tutel_rank_files,
                                  scatter_state_dict)
from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params
from tutel_jax.training import all_steps, latest_step, restore_checkpoint, save_checkpoint
from support.paths import REPO

CASE = TutelCase("top2_cf1")  # E=4, M=64, H=128
SUBPROCESS_TIMEOUT = 120


def _fixture_state() -> dict[str, np.ndarray]:
    return load_torch_file(CASE.dir / "state_dict.pt")


def _assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = np.asarray(actual[key])
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert got.tobytes() == np.asarray(want).tobytes(), key  # bitwise


# --------------------------------------------------------------------------
# gather / scatter
# --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
def test_scatter_slices_experts_and_gather_inverts(size):
    state = _fixture_state()
    parts = scatter_state_dict(state, size)
    n = 4 // size
    assert len(parts) == size
    for r, part in enumerate(parts):
        assert list(part) == list(state)
        assert int(part["_num_global_experts"]) == 4
        np.testing.assert_array_equal(part["gates.0.wg.weight"], state["gates.0.wg.weight"])
        for key in ("experts.batched_fc1_w", "experts.batched_fc2_w", "experts.batched_fc1_bias",
                    "experts.batched_fc2_bias"):
            assert part[key].shape == (n,) + state[key].shape[1:]
            np.testing.assert_array_equal(part[key], state[key][r * n:(r + 1) * n])
    _assert_state_dicts_equal(gather_state_dicts(parts), state)


def test_scatter_shares_experts_over_ranks_and_gather_inverts():
    state = _fixture_state()
    parts = scatter_state_dict(state, 8)  # s = 2 ranks per expert
    assert [p["experts.batched_fc1_w"].shape for p in parts] == [(1, 64, 64)] * 8
    assert parts[0]["experts.batched_fc2_w"].shape == (1, 64, 64)
    assert parts[0]["experts.batched_fc1_bias"].shape == (1, 64)
    assert parts[0]["experts.batched_fc2_bias"].shape == (1, 32)
    for r, part in enumerate(parts):
        expert, j = divmod(r, 2)
        # chunk j of expert r // 2: rows j*64.. of fc1's [128, 64], values j*32.. of fc2's bias [64]
        np.testing.assert_array_equal(part["experts.batched_fc1_w"][0],
                                      state["experts.batched_fc1_w"][expert, j * 64:(j + 1) * 64])
        np.testing.assert_array_equal(part["experts.batched_fc2_bias"][0],
                                      state["experts.batched_fc2_bias"][expert, j * 32:(j + 1) * 32])
        assert part["gates.0.wg.weight"].shape == (4, 64) and int(part["_num_global_experts"]) == 4
    _assert_state_dicts_equal(gather_state_dicts(parts), state)


def test_padded_flat_chunks_round_trip():
    """An odd output dim: fc2's bias [E, 63] is zero-padded to 2 x 32 per expert; gather drops the padding."""
    rng = np.random.default_rng(0)
    state = _fixture_state()
    state["experts.batched_fc2_w"] = rng.standard_normal((4, 128, 63)).astype(np.float32)
    state["experts.batched_fc2_bias"] = rng.standard_normal((4, 63)).astype(np.float32)
    parts = scatter_state_dict(state, 8)
    assert parts[1]["experts.batched_fc2_bias"].shape == (1, 32) and parts[1]["experts.batched_fc2_bias"][0, -1] == 0
    _assert_state_dicts_equal(gather_state_dicts(parts), state)
    del state["experts.batched_fc2_w"]  # nothing to recover the true length from: refused up front
    with pytest.raises(ValueError, match="batched_fc2_bias.*63"):
        scatter_state_dict(state, 8)


def test_several_prefixed_layers_with_different_expert_counts():
    rng = np.random.default_rng(1)
    state = {"embed.weight": rng.standard_normal((10, 8)).astype(np.float32)}
    for name, e in (("layers.0.moe.", 4), ("layers.1.moe.", 2)):
        state[name + "_num_global_experts"] = np.asarray(e, np.int64)
        state[name + "gates.0.wg.weight"] = rng.standard_normal((e, 8)).astype(np.float32)
        state[name + "experts.batched_fc1_w"] = rng.standard_normal((e, 6, 8)).astype(np.float32)
    parts = scatter_state_dict(state, 4)
    assert parts[3]["layers.0.moe.experts.batched_fc1_w"].shape == (1, 6, 8)
    assert parts[3]["layers.1.moe.experts.batched_fc1_w"].shape == (1, 3, 8)  # shared by 2 ranks
    np.testing.assert_array_equal(parts[3]["embed.weight"], state["embed.weight"])
    _assert_state_dicts_equal(gather_state_dicts(parts), state)


def test_incompatible_sizes_are_refused():
    state = _fixture_state()
    with pytest.raises(ValueError, match=r"E=4 .* N=3"):
        scatter_state_dict(state, 3)
    with pytest.raises(ValueError, match=r"E=4 .* N=3"):
        gather_state_dicts(scatter_state_dict(state, 1) * 3)
    with pytest.raises(ValueError, match="no Tutel MoE layer"):
        scatter_state_dict({"w": np.zeros(3)}, 2)
    with pytest.raises(ValueError, match="looks like an expert tensor"):
        scatter_state_dict({"_num_global_experts": np.asarray(2), "other.experts.w": np.zeros((2, 2))}, 2)


def test_gather_refuses_inconsistent_ranks():
    parts = scatter_state_dict(_fixture_state(), 2)
    bad = [dict(p) for p in parts]
    bad[1]["_num_global_experts"] = np.asarray(8, np.int64)
    with pytest.raises(ValueError, match=r"inconsistent '_num_global_experts': 4 in rank 0 but 8 in rank 1"):
        gather_state_dicts(bad)
    bad = [dict(p) for p in parts]
    bad[1]["experts.batched_fc1_w"] = bad[1]["experts.batched_fc1_w"][:, :64]
    with pytest.raises(ValueError, match=r"'experts.batched_fc1_w' has shape \[2, 64, 64\].* in b.pt but "
                                         r"\[2, 128, 64\].* in a.pt"):
        gather_state_dicts(bad, names=["a.pt", "b.pt"])
    bad = [dict(p) for p in parts]
    del bad[1]["gates.0.wg.weight"]
    with pytest.raises(ValueError, match=r"missing \['gates.0.wg.weight'\]"):
        gather_state_dicts(bad)
    with pytest.raises(ValueError, match="holds 2 experts"):  # 2-rank files read as 4 ranks
        gather_state_dicts(parts + parts)


def test_rank_path():
    assert rank_path("/c/moe-{rank}-of-{size}.pt", 3, 8) == "/c/moe-3-of-8.pt"
    assert rank_path("/c/full.pt", 0, 1) == "/c/full.pt"
    with pytest.raises(ValueError, match=r"no '\{rank\}'"):
        rank_path("/c/moe-{size}.pt", 0, 2)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 1\]"):
        rank_path("/c/moe-{rank}.pt", 2, 2)


def test_rank_files_round_trip_to_params(tmp_path):
    config = make_config({"type": "top", "k": 2}, 16, {"type": "ffn", "count_per_node": 1,
                                                      "hidden_size_per_expert": 8}, world_size=4)
    params = init_params(config, jax.random.key(0))
    pattern = str(tmp_path / "ckpt" / "moe-{rank}-of-{size}.pt")
    for world_size in (2, 8):
        paths = save_tutel_rank_files(params, 4, pattern, world_size)
        assert paths == [rank_path(pattern, r, world_size) for r in range(world_size)]
        restored = load_tutel_rank_files_as_params(pattern, world_size, params, 4)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
            np.testing.assert_array_equal(a, b)
    os.remove(rank_path(pattern, 5, 8))
    with pytest.raises(FileNotFoundError, match="moe-5-of-8.pt"):
        load_tutel_rank_files(pattern, 8)


@pytest.mark.torch
def test_rank_files_load_in_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="optional: checks that torch.load reads the rank files")
    state = _fixture_state()
    params = {"gates": [{"wg": {"weight": state["gates.0.wg.weight"]}}],
              "experts": {k.split(".")[-1]: v for k, v in state.items() if k.startswith("experts.")}}
    pattern = str(tmp_path / "moe-{rank}-of-{size}.pt")
    for size, fc1, fc2_bias in ((2, [2, 128, 64], [2, 64]), (8, [1, 64, 64], [1, 32])):
        paths = save_tutel_rank_files(params, 4, pattern, size)
        loaded = torch.load(paths[-1], weights_only=True)
        assert list(loaded["experts.batched_fc1_w"].shape) == fc1
        assert list(loaded["experts.batched_fc2_bias"].shape) == fc2_bias
        assert list(loaded["gates.0.wg.weight"].shape) == [4, 64] and int(loaded["_num_global_experts"]) == 4
        np.testing.assert_array_equal(loaded["experts.batched_fc1_w"].numpy(),
                                      scatter_state_dict(state, size)[-1]["experts.batched_fc1_w"])


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tutel_jax.checkpoint", *args], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, cwd=REPO)


def test_cli_scatter_then_gather(tmp_path):
    fixture = CASE.dir / "state_dict.pt"
    pattern = str(tmp_path / "moe-{rank}-of-{size}.pt")
    run = _cli("scatter", f"--input={fixture}", "--output_size=8", f"--outputs={pattern}")
    assert run.returncode == 0, run.stderr
    expected = scatter_state_dict(_fixture_state(), 8)
    for r in range(8):
        _assert_state_dicts_equal(load_torch_file(rank_path(pattern, r, 8)), expected[r])
    run = _cli("gather", "--inputs", pattern, "--input_size", "8", "--output", str(tmp_path / "full.pt"))
    assert run.returncode == 0, run.stderr
    _assert_state_dicts_equal(load_torch_file(tmp_path / "full.pt"), _fixture_state())


def test_cli_errors_exit_2_without_traceback(tmp_path):
    pattern = str(tmp_path / "moe-{rank}-of-{size}.pt")
    save_tutel_rank_files({"gates": [{"wg": {"weight": np.zeros((4, 2), np.float32)}}],
                           "experts": {"batched_fc1_w": np.zeros((4, 2, 2), np.float32)}}, 4, pattern, 4)
    os.remove(rank_path(pattern, 2, 4))
    run = _cli("gather", f"--inputs={pattern}", "--input_size=4", f"--output={tmp_path / 'full.pt'}")
    assert run.returncode == 2
    assert "error:" in run.stderr and "moe-2-of-4.pt" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "full.pt").exists()
    run = _cli("scatter", f"--input={CASE.dir / 'state_dict.pt'}", "--output_size=3", f"--outputs={pattern}")
    assert run.returncode == 2 and "error:" in run.stderr and "E=4" in run.stderr and "Traceback" not in run.stderr


# --------------------------------------------------------------------------
# Orbax: 8-device expert-parallel training state restored onto 8, 4 and 1 devices
# --------------------------------------------------------------------------

M, H, E = 16, 32, 8
TOKENS_PER_SHARD = 16
GATE = {"type": "top", "k": 2, "capacity_factor": 1.0}  # tokens can be dropped: routing depends on the shard


def _config(count_per_node: int, world_size: int):
    return make_config(GATE, M, {"type": "ffn", "count_per_node": count_per_node, "hidden_size_per_expert": H},
                       world_size=world_size)


def _model(apply_layer, params, x):
    """Two residual MoE layers; returns (output, mean aux loss)."""
    y1, aux1 = apply_layer(params["moe1"], x)
    h = x + y1
    y2, aux2 = apply_layer(params["moe2"], h)
    return h + y2, (aux1.l_aux + aux2.l_aux) / 2


def _loss(out, l_aux, target):
    return jnp.mean((out - target) ** 2) + 0.01 * l_aux


def _ep_loss_fn(world_size: int, devices):
    """Loss of the model run expert-parallel over `devices` (each device routes its own token shard)."""
    placement = ExpertParallel(Mesh(np.array(devices), ("expert",)))
    config = _config(E // world_size, world_size)

    def loss(params, x, target):
        out, l_aux = _model(lambda p, h: moe_apply_parallel(p, h, config, placement), params, x)
        return _loss(out, l_aux, target)

    return placement, jax.jit(loss)


def _per_shard_loss_fn(num_shards: int):
    """The same loss on ONE device per call, routing each of `num_shards` token shards separately.

    With EP over D devices every device routes its own B/D tokens (capacity from the local token count, drops
    decided per shard, l_aux averaged over devices), so the EP loss equals the single-device layer applied
    shard by shard with the same partition -- and not the single-device layer on the whole batch. This is the
    fair reference that any placement of the restored parameters can be evaluated with.
    """
    config = _config(E, 1)

    def loss(params, x, target):
        xs = x.reshape(num_shards, -1, M)
        outs, l_aux = jax.vmap(lambda xi: _model(lambda p, h: moe_apply(p, h, config), params, xi))(xs)
        return _loss(outs.reshape(x.shape), jnp.mean(l_aux), target)

    return jax.jit(loss)


def _state_shardings(state, mesh: Mesh):
    """Expert tensors (params and their adam moments) split on dim 0 over 'expert'; everything else replicated."""
    def sharding(path, _):
        in_experts = any(getattr(k, "key", None) == "experts" for k in path)
        return NamedSharding(mesh, P("expert") if in_experts else P())

    return jax.tree_util.tree_map_with_path(sharding, state)


def _assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_orbax_restore_onto_other_meshes(tmp_path):
    devices = jax.devices()[:8]
    placement8, ep8_loss = _ep_loss_fn(8, devices)
    config8 = _config(1, 8)
    keys = jax.random.split(jax.random.key(0), 5)
    params = {"moe1": shard_params(init_params(config8, keys[0]), placement8),
              "moe2": shard_params(init_params(config8, keys[1]), placement8)}
    tokens = 8 * TOKENS_PER_SHARD
    x_train, t_train, x_eval, t_eval = (jax.random.normal(k, (tokens, M)) for k in jax.random.split(keys[2], 4))
    optimizer = optax.adam(1e-2)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.asarray(0, jnp.int32)}
    shardings8 = _state_shardings(state, placement8.mesh)
    state = jax.device_put(state, shardings8)  # pinned layout: one compilation of the step

    @partial(jax.jit, out_shardings=shardings8)
    def train_step(state, x, target):
        grads = jax.grad(ep8_loss)(state["params"], x, target)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "step": state["step"] + 1}

    for _ in range(2):
        state = train_step(state, x_train, t_train)
    assert state["params"]["moe1"]["experts"]["batched_fc1_w"].sharding.spec == P("expert")
    # What "the same eval loss" means: capacity_factor=1 drops tokens per routing group and l_aux is averaged
    # over groups, so a loss depends on how the tokens are split into routing groups, not only on the
    # parameters. The reference is the native EP-8 loss (8 groups of 16 tokens); every restored copy is then
    # evaluated with the single-device layer on the SAME 8 groups (`eval8`), wherever its arrays live, which
    # must give the reference exactly when the restored values are right. Native EP-4 (4 groups of 32) is
    # compared with the single-device layer on those 4 groups instead.
    reference = float(ep8_loss(state["params"], x_eval, t_eval))
    eval8 = _per_shard_loss_fn(8)
    # the fair reference holds: EP-8 == the single-device layer on the same 8 token shards
    np.testing.assert_allclose(float(eval8(state["params"], x_eval, t_eval)), reference, rtol=1e-5)

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, state, step=2)
    assert latest_step(ckpt) == 2 and all_steps(ckpt) == [2]

    # (a) the same 8-device EP layout, evaluated natively with expert parallelism
    restored8 = restore_checkpoint(ckpt, shardings8)
    _assert_trees_equal(restored8, state)
    assert restored8["opt_state"][0].mu["moe2"]["experts"]["batched_fc2_w"].sharding.spec == P("expert")
    np.testing.assert_allclose(float(ep8_loss(restored8["params"], x_eval, t_eval)), reference, rtol=1e-5)

    # (b) 4 devices holding 2 experts each (E stays 8); abstract target built by the caller
    placement4, ep4_loss = _ep_loss_fn(4, jax.devices()[:4])
    abstract4 = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             state, _state_shardings(state, placement4.mesh))
    restored4 = restore_checkpoint(ckpt, abstract4, step=2)
    _assert_trees_equal(restored4, state)
    w4 = restored4["params"]["moe1"]["experts"]["batched_fc1_w"]
    assert len(w4.sharding.device_set) == 4 and w4.addressable_shards[0].data.shape == (2, H, M)
    np.testing.assert_allclose(float(eval8(restored4["params"], x_eval, t_eval)), reference, rtol=1e-5)
    # native EP-4 routes 4 shards of 32 tokens: compare with the single-device layer on that partition
    np.testing.assert_allclose(float(ep4_loss(restored4["params"], x_eval, t_eval)),
                               float(_per_shard_loss_fn(4)(state["params"], x_eval, t_eval)), rtol=1e-5)

    # (c) one device, single-device layer (count_per_node=8)
    one = SingleDeviceSharding(jax.devices()[0])
    restored1 = restore_checkpoint(ckpt, jax.tree.map(lambda _: one, state))
    _assert_trees_equal(restored1, state)
    assert all(leaf.sharding == one for leaf in jax.tree.leaves(restored1))
    np.testing.assert_allclose(float(eval8(restored1["params"], x_eval, t_eval)), reference, rtol=1e-5)

    # a restored optimizer state continues training exactly like the original one
    continued = train_step(restored8, x_train, t_train)
    _assert_trees_equal(continued, train_step(state, x_train, t_train))


def test_orbax_restore_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        restore_checkpoint(tmp_path / "nothing", {"w": jnp.zeros(2)})
    assert latest_step(tmp_path / "nothing") is None
    save_checkpoint(tmp_path, {"w": jnp.arange(4.0)}, step=0)
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(tmp_path, {"w": jnp.arange(4.0)}, step=0)
    with pytest.raises(FileNotFoundError, match="step 3"):
        restore_checkpoint(tmp_path, {"w": jnp.zeros(4)}, step=3)
    with pytest.raises(ValueError, match=r"target shape \[8\] for 'w' differs from the stored global shape \[4\]"):
        restore_checkpoint(tmp_path, {"w": jnp.zeros(8)})
    with pytest.raises(ValueError, match=r"not stored \['v'\]"):
        restore_checkpoint(tmp_path, {"w": jnp.zeros(4), "v": jnp.zeros(4)})


# --------------------------------------------------------------------------
# Atomicity under SIGKILL
# --------------------------------------------------------------------------

_CHILD_PRELUDE = """
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np

def values(step, n, size):  # random, so that Orbax's compression does not shrink the save
    rng = np.random.default_rng(step)
    return {f"a{i:03d}": rng.random(size, np.float32) for i in range(n)}
"""


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=REPO)


def _bytes_under(directory: Path, name_prefix: str) -> int:
    """Bytes in the files and folders of `directory` whose names start with `name_prefix` (0 if none)."""
    total = 0
    for root, _, files in os.walk(directory):
        if os.path.relpath(root, directory).startswith(name_prefix):
            total += sum(_size(os.path.join(root, f)) for f in files)
        elif root == str(directory):
            total += sum(_size(os.path.join(root, f)) for f in files if f.startswith(name_prefix))
    return total


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # renamed or removed meanwhile
        return 0


def _kill_when_started(code: str, args: list[str], started) -> None:
    """Runs a child that prints 'saving' right before its big save and SIGKILLs it as soon as `started()` (part
    of the save's temporary file / folder is written), or lets it finish if it is faster than that."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(code), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        ready, _, _ = select.select([child.stdout], [], [], SUBPROCESS_TIMEOUT)
        line = child.stdout.readline() if ready else ""
        assert line.strip() == "saving", (line, child.stderr.read() if child.poll() is not None else "timeout")
        while time.monotonic() < deadline and child.poll() is None:
            if started():
                child.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        child.wait(timeout=30)
        assert child.returncode in (0, -signal.SIGKILL), child.stderr.read()[-3000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()


_ORBAX_SAVER = """
from tutel_jax.training import save_checkpoint
directory, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
save_checkpoint(directory, values(1, 4, 1000), step=1)
big = values(2, n, size)
print("saving", flush=True)
save_checkpoint(directory, big, step=2)
print("saved", flush=True)
"""

_ORBAX_CHECKER = """
import jax
from tutel_jax.training import all_steps, latest_step, restore_checkpoint, save_checkpoint
directory = sys.argv[1]
assert latest_step(directory) == 1, all_steps(directory)
target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
          for k, v in values(1, 4, 1000).items()}
restored = restore_checkpoint(directory, target)
for k, v in values(1, 4, 1000).items():
    assert np.array_equal(np.asarray(restored[k]), v), k
save_checkpoint(directory, values(3, 2, 10), step=3)  # a new save still works and clears the leftover
assert all_steps(directory) == [1, 3], all_steps(directory)
assert not [p for p in os.listdir(directory) if "tmp" in p], os.listdir(directory)
print("ok")
"""


def test_orbax_save_killed_midway_keeps_previous_step(tmp_path):
    # bigger states until a kill lands while step 2 is being written (the first one nearly always does)
    for attempt, (n, size) in enumerate([(64, 250_000), (128, 500_000)]):  # 64 MB, then 256 MB
        d = tmp_path / str(attempt)
        started = lambda d=d: _bytes_under(d, "2.orbax-checkpoint-tmp") > 8 << 20  # data partly written
        _kill_when_started(_ORBAX_SAVER, [str(d), str(n), str(size)], started)
        steps = all_steps(d)
        assert steps in ([1], [1, 2]), steps
        if steps == [1]:
            break
    else:
        pytest.fail("every save finished before it could be killed")
    assert any("tmp" in p.name for p in d.iterdir())  # the unfinished save's folder is left ...
    assert latest_step(d) == 1  # ... and never listed as a step
    run = _run_child(_ORBAX_CHECKER, str(d))  # a fresh process restores step 1 intact
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


_TORCH_SAVER = """
from tutel_jax.checkpoint import save_torch_file
path, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
save_torch_file(path, values(1, 4, 1000))
big = values(2, n, size)
print("saving", flush=True)
save_torch_file(path, big)
"""


def _values(step: int, n: int, size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)  # as the children's values()
    return {f"a{i:03d}": rng.random(size, np.float32) for i in range(n)}


def test_save_torch_file_killed_midway_keeps_previous_file(tmp_path):
    for attempt, (n, size) in enumerate([(32, 500_000), (64, 1_000_000)]):  # 64 MB, then 256 MB
        d = tmp_path / str(attempt)
        d.mkdir()
        path = d / "model.pt"
        started = lambda d=d: _bytes_under(d, ".model.pt.") > 8 << 20  # temp file partly written
        _kill_when_started(_TORCH_SAVER, [str(path), str(n), str(size)], started)
        loaded = load_torch_file(path)  # never a torn file: the old one or the complete new one
        if len(loaded) == 4:
            break
        _assert_state_dicts_equal(loaded, _values(2, n, size))
    else:
        pytest.fail("every save finished before it could be killed")
    _assert_state_dicts_equal(loaded, _values(1, 4, 1000))
    assert any(p.name.startswith(".model.pt.") for p in d.iterdir())  # the killed write's temp file is left


def test_every_leaf_type_save_accepts_restores_as_that_type(tmp_path):
    """Save and restore are symmetric: NumPy scalars (e.g. a step counter np.int32(0)) come back as NumPy
    scalars of the same type and value, next to jax arrays, NumPy arrays and Python scalars."""
    state = {"step": np.int32(7), "lr": np.float32(0.25), "count": np.int64(-3), "w": jnp.arange(4.0),
             "host": np.ones((2, 3), np.float32), "epoch": 5, "scale": 0.5}
    save_checkpoint(tmp_path / "ckpt", state, 0)
    target = {"step": np.int32(0), "lr": np.float32(0), "count": np.int64(0), "w": jnp.zeros(4),
              "host": np.zeros((2, 3), np.float32), "epoch": 0, "scale": 0.0}
    restored = restore_checkpoint(tmp_path / "ckpt", target)
    for key, value in state.items():
        got = restored[key]
        if isinstance(value, np.generic):
            assert type(got) is type(value) and got == value, (key, got)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=key)
