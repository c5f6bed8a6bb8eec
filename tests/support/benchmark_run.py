"""Runs a benchmark script's --quick mode in a subprocess for the smoke tests: CPU only, a deadline, the JSON it
wrote. The smoke runs compile without LLVM optimisation (FAST_COMPILE): at their tiny sizes compiling is most of
their time, and their timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.xla_flags import with_fast_compile
from support.paths import REPO


def run_quick(name: str, out: Path, *args: str, timeout_s: float = 300, **env: str) -> dict[str, Any]:
    """`python benchmarks/<name>.py --quick --out <out> <args>`; asserts exit 0 and returns the JSON result."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    env["XLA_FLAGS"] = with_fast_compile(env.get("XLA_FLAGS", ""))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out),
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
