"""`benchmarks/vs_llamacpp.py --quick`: the tutel-jax half of the side-by-side benchmark on the tiny GPT-OSS layout
(the llama.cpp half builds llama.cpp and converts a real-size checkpoint: not a test)."""

from __future__ import annotations

from support.benchmark_run import run_quick
from tutel_jax.native import build


def test_vs_llamacpp_quick(tmp_path):
    out = tmp_path / "vs.json"
    result = run_quick("vs_llamacpp", out, "--rounds", "2", "--work-dir", str(tmp_path / "work"))
    assert result["model"] == "gpt-oss-20b-tiny" and result["rounds"] == 2 and "llama_cpp" not in result
    assert result["threads"] >= 1 and result["read_bandwidth_bytes_per_s"] > 0
    tj = result["tutel_jax"]
    assert len(result["tutel_jax_rounds"]) == 2
    for key in ("decode_b1_tok_s", "prefill_512_tok_s", "decode_b8_tok_s", "load_seconds", "peak_rss_bytes"):
        assert tj[key] > 0, key
        values = sorted(r[key] for r in result["tutel_jax_rounds"])
        assert values[0] <= tj[key] <= values[-1], key  # the median of the rounds
    assert tj["isa"] == build.isa_in_effect()  # the native kernels' instruction set, recorded
    assert tj["roofline_b1"] == tj["bytes_per_step_b1"] * tj["decode_b1_tok_s"] / result["read_bandwidth_bytes_per_s"]
    md = out.with_suffix(".md").read_text()
    assert "| decode, batch 1 (tok/s) |" in md and "not run" in md
