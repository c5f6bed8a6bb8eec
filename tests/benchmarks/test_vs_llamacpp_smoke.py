"""`benchmarks/vs_llamacpp.py --quick`: the tutel-jax half of the side-by-side benchmark on the tiny GPT-OSS layout
(the llama.cpp half builds llama.cpp and converts a real-size checkpoint: not a test)."""

from __future__ import annotations

import json

import pytest

from benchmarks import vs_llamacpp
from support.benchmark_run import run_quick
from tutel_jax.native import _build as build


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
    # each round's batch-1 steps against the reads between them, in its own process; medians
    rooflines, bandwidths = [], []
    for r in result["tutel_jax_rounds"]:
        assert r["read_bandwidth_bytes_per_s"] > 0 and r["roofline_b1_tok_s"] > 0
        assert r["roofline_b1"] == pytest.approx(r["bytes_per_step_b1"] * r["roofline_b1_tok_s"]
                                                 / r["read_bandwidth_bytes_per_s"], rel=1e-12)
        rooflines.append(r["roofline_b1"])
        bandwidths.append(r["read_bandwidth_bytes_per_s"])
    assert tj["roofline_b1"] == pytest.approx(sum(rooflines) / 2, rel=1e-12)  # the median of two rounds
    assert result["read_bandwidth_bytes_per_s"] == pytest.approx(sum(bandwidths) / 2, rel=1e-12)
    md = out.with_suffix(".md").read_text()
    assert "| decode, batch 1 (tok/s) |" in md and "not run" in md


def test_serving_table_and_serving_only_errors(tmp_path, capsys):
    """The serving comparison's table, and --serving-only's refusals (one line, exit 2): with --quick, without an
    existing results file, or with another model's."""
    one = {"requests_per_s": 0.5, "tokens_per_s": 4.0, "wall_s": 16.0, "latency_p50_s": 8.1, "latency_p99_s": 8.3}
    result = {"model": "m", "threads": 2, "rounds": 1, "read_bandwidth_bytes_per_s": 2e10,
              "read_bandwidth_method": "x", "prompt_len": 512,
              "tutel_jax": {"decode_b1_tok_s": 1.0, "bytes_per_step_b1": 1e9, "roofline_b1": 0.05},
              "serving": {"clients": 4, "requests": 8, "max_tokens": 8, "prompt_tokens": 16, "slot_len": 256,
                          "tutel_jax": one, "llama_cpp": dict(one, requests_per_s=0.25)}}
    md = vs_llamacpp.markdown(result)
    assert "| tutel-jax serve | 0.50 | 4.00 | 8.10 / 8.30 |" in md
    assert "| llama.cpp llama-server | 0.25 | 4.00 | 8.10 / 8.30 |" in md
    out = tmp_path / "r.json"
    for argv, message in ((["--serving-only", "--quick"], "not with --quick"),
                          (["--serving-only", "--out", str(out)], "adds to an existing results file"),):
        with pytest.raises(SystemExit) as e:
            vs_llamacpp.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    out.write_text(json.dumps({"model": "other"}))
    with pytest.raises(SystemExit) as e:
        vs_llamacpp.main(["--serving-only", "--out", str(out)])
    assert e.value.code == 2 and "holds 'other', not 'gpt-oss-20b'" in capsys.readouterr().err
