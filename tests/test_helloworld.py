"""End-to-end tests of `examples/helloworld.py`, run as a subprocess on 2 forced CPU devices with tiny sizes."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.xla_flags import with_fast_compile
from support.paths import REPO

SCRIPT = REPO / "examples" / "helloworld.py"
TIMEOUT_S = 240
TINY = ["--batch_size", "2", "--num_tokens", "16", "--model_dim", "32", "--hidden_size", "64"]
STEP_RE = re.compile(r"^STEP-(\d+): loss = (\S+), step_time = \S+ sec, perf = \S+ tflops\.$", re.MULTILINE)


def run_example(*args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Runs the example on 2 CPU devices; asserts a zero exit status when `expect_ok`."""
    env = dict(os.environ)
    # without LLVM optimisation (about a third less compile time, most of a tiny run's; every run alike)
    env["XLA_FLAGS"] = with_fast_compile("--xla_force_host_platform_device_count=2")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if expect_ok:
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def step_losses(stdout: str) -> dict[int, str]:
    """{step index: loss exactly as printed (%.5f)}."""
    return {int(i): loss for i, loss in STEP_RE.findall(stdout)}


def test_train_checkpoint_resume_and_plot(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    png = tmp_path / "plots" / "load.png"

    # 3 steps from scratch, saving a checkpoint at the end.
    first = run_example(*TINY, "--num_steps", "3", "--checkpoint_path", str(ckpt))
    out = first.stdout
    assert "world_size = 2" in out
    assert "[Statistics] param count for MoE local_experts" in out
    assert "Will train the model from start" in out
    losses = step_losses(out)
    assert sorted(losses) == [0, 1, 2], out
    assert all(math.isfinite(float(v)) for v in losses.values()), losses
    assert float(losses[2]) < float(losses[0]), f"loss does not decrease: {losses}"
    assert "[Summary] Average synchronized step_time" in out
    assert (ckpt / "3").is_dir(), sorted(p.name for p in ckpt.iterdir())

    # Resume for 1 step: restores params + optimizer state + step counter.
    resumed = run_example(*TINY, "--num_steps", "1", "--checkpoint_path", str(ckpt))
    assert "Checkpoint restored" in resumed.stdout and "at step 3" in resumed.stdout, resumed.stdout
    resumed_losses = step_losses(resumed.stdout)
    assert list(resumed_losses) == [3], resumed.stdout
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["4"]

    # Uninterrupted 4-step reference (also writes the load plot): its 4th loss is the resumed run's first.
    reference = run_example(*TINY, "--num_steps", "4", "--plot", str(png))
    ref_losses = step_losses(reference.stdout)
    assert sorted(ref_losses) == [0, 1, 2, 3], reference.stdout
    assert [ref_losses[i] for i in range(3)] == [losses[i] for i in range(3)]
    assert resumed_losses[3] == ref_losses[3], (resumed_losses, ref_losses)

    data = png.read_bytes()
    assert len(data) > 8 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_is_forward_only() -> None:
    proc = run_example(*TINY, "--num_steps", "3", "--eval", "--top", "1", "--capacity_factor", "0.5")
    losses = step_losses(proc.stdout)
    assert sorted(losses) == [0, 1, 2], proc.stdout
    assert len(set(losses.values())) == 1, f"--eval must not update the model: {losses}"
    assert math.isfinite(float(losses[0]))
    assert "mode = eval" in proc.stdout and "world_size = 2" in proc.stdout
    assert "[Summary] Average synchronized step_time" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--top", "0"], "--top"),
    (["--dtype", "int8"], "--dtype"),
    (["--batch_size", "-1"], "--batch_size"),
])
def test_bad_flag_values_fail_cleanly(flags: list[str], message: str) -> None:
    proc = run_example(*TINY, *flags, expect_ok=False)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "STEP-" not in proc.stdout
