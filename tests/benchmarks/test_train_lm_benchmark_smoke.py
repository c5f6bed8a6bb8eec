"""benchmarks/train_lm.py runs end to end at tiny sizes (--quick): MoE and dense trained side by side on the same
batches, both evaluated at the same steps, the result files and both figures written. Losses and speeds are not
asserted (a 6-step run says nothing about which model is better); the structure is."""

from __future__ import annotations

from support.benchmark_run import run_quick


def test_train_lm_benchmark_quick(tmp_path):
    out = tmp_path / "train_lm_cpu_quick.json"
    result = run_quick("train_lm", out)
    moe, dense = result["runs"]["moe"], result["runs"]["dense"]
    assert moe["steps"] == dense["steps"] == 6 and moe["tokens"] == dense["tokens"] == 6 * 8 * 32
    assert [e["step"] for e in moe["evals"]] == [e["step"] for e in dense["evals"]] == [0, 3, 6]
    assert moe["active_params"] == dense["active_params"] < moe["total_params"]
    assert moe["final_val_bpb"] == moe["evals"][-1]["val_bpb"] > 0
    loads = moe["load"]
    assert loads and all(abs(sum(layer) - 1.0) < 1e-5 for e in loads for layer in e["load"])  # shares of [E]
    table = out.with_suffix(".md").read_text()
    assert "| moe |" in table and "| dense |" in table and "bits/byte" in table
    for png in ("train_lm_quick_loss.png", "train_lm_quick_expert_load.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
