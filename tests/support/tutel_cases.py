"""One Tutel oracle case of tests/fixtures/tutel: its config, state dict file and recorded arrays."""

from __future__ import annotations

import json

import numpy as np
from support.paths import TUTEL



class TutelCase:
    """One Tutel oracle case: its config, state dict file and recorded arrays."""

    def __init__(self, name: str):
        self.name = name
        self.dir = TUTEL / name
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
