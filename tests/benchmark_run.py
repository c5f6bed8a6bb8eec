"""Runs a benchmark script's --quick mode in a subprocess for the smoke tests: CPU only, a deadline, the JSON it
wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_quick(name: str, out: Path, *args: str, timeout_s: float = 300, **env: str) -> dict[str, Any]:
    """`python benchmarks/<name>.py --quick --out <out> <args>`; asserts exit 0 and returns the JSON result."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out),
                           *args], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", **env), capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
