"""`examples/train_lm.py`: bit-exact resume across a layout switch, two processes = one process, bad input, export.

A tiny model on a slice of the standard library keeps each run to a few seconds of steps (plus compilation).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from support.paths import REPO

SCRIPT = REPO / "examples" / "train_lm.py"
TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--experts", "8",
        "--top-k", "2", "--expert-hidden", "32", "--batch", "8", "--seq", "32", "--max-corpus-bytes", "300000",
        "--eval-every", "3", "--eval-batches", "1", "--warmup", "2", "--lr", "3e-3", "--log-every", "1",
        "--no-progress"]
DEADLINE_S = 300  # a multi-process run that hangs is killed and fails the test


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _losses(log: Path) -> dict[int, float]:
    out = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["event"] == "step":
            out[entry["step"]] = entry["loss"]
    return out


COMMON = TINY + ["--steps", "6", "--ckpt-every", "3", "--switch-at", "4", "--switch-to", "ep=4,dp=2"]


@pytest.fixture(scope="module")
def runs(train_lm, tmp_path_factory):
    """An uninterrupted 6-step run (switching layout before step 5, exporting at the end), and the same run
    stopped after step 3 and resumed from its checkpoint."""
    root = tmp_path_factory.mktemp("train_lm")
    whole = train_lm.run(train_lm.parse_args(COMMON + ["--ckpt-dir", str(root / "a"), "--log", str(root / "a.jsonl"),
                                                       "--export", str(root / "export")]))
    first = train_lm.run(train_lm.parse_args(COMMON + ["--ckpt-dir", str(root / "b"), "--stop-at", "3",
                                                       "--log", str(root / "b.jsonl")]))
    rest = train_lm.run(train_lm.parse_args(COMMON + ["--ckpt-dir", str(root / "b"), "--resume",
                                                      "--log", str(root / "b.jsonl")]))
    return {"root": root, "whole": whole, "first": first, "rest": rest}


def test_resume_continues_bit_for_bit_across_a_switch(runs):
    whole, first, rest = runs["whole"], runs["first"], runs["rest"]
    assert sorted(first["losses"]) == [1, 2, 3] and sorted(rest["losses"]) == [4, 5, 6]
    resumed = {**first["losses"], **rest["losses"]}
    assert resumed == whole["losses"]  # exact float equality: same data, same noise, same programs
    assert [s["to"] for s in whole["switches"]] == [s["to"] for s in rest["switches"]]
    assert "expert=4" in whole["switches"][0]["to"]
    assert _losses(runs["root"] / "b.jsonl") == whole["losses"]  # the log appended across the resume
    losses = list(whole["losses"].values())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # it learns
    assert whole["evals"][-1]["step"] == 6 and whole["evals"][-1]["val_bpb"] > 0


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_two_processes_give_the_loss_curve_of_one(runs, tmp_path):
    args = COMMON  # the uninterrupted run's settings, layout switch included (checkpoints aside)
    single = runs["whole"]
    for attempt in range(2):  # one hang (once in CI, cause unknown) is reported with its stacks and run again
        log = tmp_path / f"two{attempt}.jsonl"
        done = subprocess.run([sys.executable, str(SCRIPT), *args, "--num-processes", "2", "--timeout",
                               str(DEADLINE_S - 30), "--log", str(log)], env=_child_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=DEADLINE_S)
        if done.returncode != 124:
            break
        warnings.warn(f"the two-process run hung (attempt {attempt + 1}); the processes' stacks:\n"
                      f"{done.stderr[-12000:]}")
    assert done.returncode == 0, done.stderr[-12000:]
    two = _losses(log)
    assert sorted(two) == sorted(single["losses"])
    # the same global batches, mesh order and per-device work; only cross-process reductions may round apart
    np.testing.assert_allclose([two[s] for s in sorted(two)], [single["losses"][s] for s in sorted(two)],
                               rtol=1e-5, atol=0)


def _main_error(train_lm, argv, capsys) -> str:
    assert train_lm.main(argv) == 2
    return capsys.readouterr().err


def test_bad_input_is_a_clear_error(train_lm, runs, tmp_path, capsys):
    missing = tmp_path / "no_such_corpus"
    assert str(missing) in _main_error(train_lm, TINY + ["--steps", "1", "--corpus", str(missing)], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert str(empty) in _main_error(train_lm, TINY + ["--steps", "1", "--corpus", str(empty)], capsys)
    err = _main_error(train_lm, TINY + ["--steps", "1", "--batch", "12"], capsys)
    assert "--batch 12" in err and "8 devices" in err
    err = _main_error(train_lm, TINY + ["--steps", "3", "--autotune", "ep=8; ep=3"], capsys)
    assert "ep=3" in err or "expert=3" in err
    # a checkpoint of another model shape: refused by name, and the checkpoint is left as it was
    ckpt = runs["root"] / "a"
    before = sorted(p.name for p in ckpt.iterdir())
    wider = [a if a != "32" or TINY[i - 1] != "--hidden" else "48" for i, a in enumerate(TINY)]
    err = _main_error(train_lm, wider + ["--steps", "8", "--ckpt-dir", str(ckpt), "--resume"], capsys)
    assert "shape" in err and str(ckpt) in err
    assert sorted(p.name for p in ckpt.iterdir()) == before
    err = _main_error(train_lm, TINY + ["--steps", "2", "--ckpt-dir", str(tmp_path / "none"), "--resume"], capsys)
    assert "no checkpoint" in err


def test_export_loads_generates_and_serves(runs, tmp_path):
    from support.server_process import served
    import httpx
    from tutel_jax.lm import _byte_tokenizer as byte_tokenizer, init_lm, LMSize
    from tutel_jax.models import from_pretrained
    from tutel_jax.serving import generate

    out = runs["root"] / "export"
    assert runs["whole"]["export"] == str(out)
    model = from_pretrained(out)
    assert model.config["model_type"] == "qwen3_moe" and model.config["vocab_size"] == 256
    prompt = np.asarray([byte_tokenizer.encode("def ")], np.int32)
    ids = np.asarray(generate(model, prompt, 8).tokens)
    assert ids.shape == (1, 8) and ids.min() >= 0 and ids.max() < 256
    fresh = init_lm(LMSize(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, experts=8, top_k=2,
                           expert_hidden=32), seed=0)
    trained = np.asarray(model.params["embed"])
    assert trained.shape == np.asarray(fresh.params["embed"]).shape
    assert not np.array_equal(trained, np.asarray(fresh.params["embed"]))  # the trained weights, not the init
    with served(out, ["--max-tokens", "8"], tmp_path) as base:
        reply = httpx.post(base + "/v1/completions", json={"prompt": "def ", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert isinstance(reply.json()["choices"][0]["text"], str)


def test_execution_flags_reach_the_runtime(train_lm, tmp_path):
    """The shared execution flags: layout switches override --runtime's text; kernels are the runtime level;
    a knob training cannot apply is refused by name."""
    args = train_lm.parse_args(TINY + ["--steps", "1", "--runtime", "ep=8,d=1", "--a2a-overlap-degree", "2",
                                       "--adaptive-r", "0", "--kernel-backend", "xla"])
    run = train_lm.LMRun(args, say=lambda text: None)
    assert run.trainer.runtime.a2a_ffn_overlap_degree == 2 and run.trainer.runtime.adaptive_r == 0
    with pytest.raises(SystemExit):
        train_lm.parse_args(TINY + ["--per-layer-jit", "on"])
