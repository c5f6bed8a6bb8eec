"""The commands' persistent compile cache (`core.enable_compile_cache`, `--compile-cache`): a second `tutel-jax
generate` loads the programs the first one compiled (the same tokens; no program compiled or written again), each
machine gets its own folder, 'off' leaves jax's cache off, and a folder that cannot be used is one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tutel_jax.cli import main
from tutel_jax.core import COMPILE_CACHE_ENV, enable_compile_cache, machine_key, user_cache_dir
from support.paths import HF


def _generate(cache: Path) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop(COMPILE_CACHE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "tutel_jax.cli", "generate", str(HF / "qwen3_moe"), "--ids", "1,2,3",
                           "--max-new-tokens", "3", "--compile-cache", str(cache)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("prompt 0:"))


def _programs(folder: Path) -> dict[str, int]:
    """{program file: its modification time}: jax writes a program's file on a miss only."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*-cache")}


def test_second_run_loads_the_first_runs_programs(tmp_path):
    first = _generate(tmp_path)
    folder = tmp_path / machine_key()
    programs = _programs(folder)
    assert any(name.startswith("jit_prefill_body-") for name in programs), sorted(programs)
    assert any(name.startswith("jit_decode_body-") for name in programs), sorted(programs)
    assert _generate(tmp_path) == first
    assert _programs(folder) == programs  # every program found: none compiled and written again


def test_machine_key_names_the_versions_and_the_cpu():
    key = machine_key()
    assert key.startswith(f"jax{jax.__version__}-jaxlib") and key == key.lower() and "/" not in key
    assert key == machine_key()


def test_off_and_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(COMPILE_CACHE_ENV, "off")
    assert enable_compile_cache(None) is None and enable_compile_cache("OFF") is None
    monkeypatch.setenv("TUTEL_JAX_CACHE", str(tmp_path))
    assert user_cache_dir() == tmp_path


def test_unusable_folder_is_one_line_and_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc = main(["generate", str(HF / "qwen3_moe"), "--ids", "1", "--compile-cache", str(blocker / "cache")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("tutel-jax generate: error: compile cache ") and "cannot create" in err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot create|not writable"):
            enable_compile_cache(locked)
