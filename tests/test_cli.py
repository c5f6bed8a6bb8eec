"""The `tutel-jax` command (installed entry point): usage, generate, and a clear error for unknown commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tutel_jax.cli import main

HF = Path(__file__).parent / "fixtures" / "hf"


def test_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0 and "serve" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


def test_generate_command_in_a_subprocess():
    e = np.load(HF / "qwen3_moe" / "expected.npz")
    prompt = ",".join(str(t) for t in e["input_ids"][0])
    exe = Path(sys.executable).with_name("tutel-jax")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tutel_jax.cli"]
    proc = subprocess.run(cmd + ["generate", str(HF / "qwen3_moe"), "--ids", prompt, "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"-> {e['greedy'][0, 12:].tolist()}" in proc.stdout
