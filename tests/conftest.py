"""Shared helpers: fixture paths and loaders. Tests run on CPU; meshes use fake host devices."""

from __future__ import annotations

import json
import os
from pathlib import Path

from xla_flags import with_fast_compile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 fake CPU devices for mesh tests; must be set before JAX initialises its backend
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["XLA_FLAGS"] = with_fast_compile(os.environ["XLA_FLAGS"])

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
TUTEL_CASES = sorted(p.name for p in (FIXTURES / "tutel").iterdir() if p.is_dir())


class TutelCase:
    """One Tutel oracle case: its config, state dict file and recorded arrays."""

    def __init__(self, name: str):
        self.name = name
        self.dir = FIXTURES / "tutel" / name
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.config = self.meta["config"]

    def array(self, name: str) -> np.ndarray:
        return np.load(self.dir / f"{name}.npy")

    def layer_kwargs(self) -> dict:
        c, m = self.config, self.meta
        return dict(
            gate_type={"type": c["gate"], "k": c["k"], "capacity_factor": c["capacity_factor"],
                       "fp32_gate": c["fp32_gate"], "gate_noise": c["gate_noise"]},
            model_dim=m["model_dim"],
            experts={"type": "ffn", "count_per_node": m["num_experts"], "hidden_size_per_expert": m["hidden"],
                     "activation_fn": c["activation"]},
            is_postscore=c["is_postscore"], batch_prioritized_routing=c["batch_prioritized_routing"],
            normalize_gate=c["normalize_gate"], is_gshard_loss=c["is_gshard_loss"],
        )


@pytest.fixture(params=TUTEL_CASES)
def tutel_case(request) -> TutelCase:
    return TutelCase(request.param)
