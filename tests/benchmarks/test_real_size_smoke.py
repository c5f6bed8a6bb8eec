"""`benchmarks/real_size.py --quick` end to end on the depth- and width-reduced GPT-OSS layout (a few MB): the
checkpoint is generated, loaded packed, compiled at several depths, prefilled and decoded, and the result files
are written, and `tutel-jax serve` answers the openai client. Timings are not asserted; the load-memory bound and
the result's structure are."""

from __future__ import annotations

import dataclasses
import json

from benchmarks import real_size
from support.benchmark_run import run_quick


def test_real_size_benchmark_quick(tmp_path):
    out = tmp_path / "real_size.json"
    run = run_quick("real_size", out, "--models", "gpt-oss-20b-tiny", "--cache-dir", str(tmp_path / "cache"))
    (result,) = run["results"]
    assert result["model"] == "gpt-oss-20b-tiny" and result["shards"] == 1
    assert result["expert_formats"] == ["float", "mxfp4"]  # biases float, weights packed
    assert result["rss_within_bound"] and result["peak_rss_load_bytes"] <= result["rss_bound_bytes"]
    assert result["checkpoint_bytes"] == (tmp_path / "cache" / "gpt-oss-20b-tiny" / "model.safetensors").stat().st_size
    # the per-layer programs (what the real depths pick), and the whole-model program for comparison
    assert result["per_layer_jit"] is True
    assert set(result["compile_s"]) == set(result["compile_whole_s"]) == {"1", "2", "4"}
    assert set(result["decode"]) == {"1", "8"}
    # the roofline is against the streaming read bandwidth of the process's CPUs, read between the steps it is
    # the roofline of (each batch: its own paired steps and reads); the table's figure: batch 1's
    assert result["read_threads"] >= 1 and result["read_gbps"] == result["decode"]["1"]["read_gbps"] > 0
    for d in result["decode"].values():
        assert d["tokens_per_s"] > 0 and 0 < d["roofline_ratio"] and d["bytes_per_step"] > 0
        assert d["read_gbps"] > 0 and d["roofline_step_s"] > 0
        ratio = d["bytes_per_step"] / d["roofline_step_s"] / (d["read_gbps"] * 1e9)
        assert abs(d["roofline_ratio"] - ratio) <= 1e-12 * ratio
    # batch 8 reads more experts than batch 1, never more than all of them
    assert result["decode"]["1"]["bytes_per_step"] < result["decode"]["8"]["bytes_per_step"] <= result["resident_bytes"]
    # `tutel-jax serve` answered the openai client (non-stream and stream) and the concurrent clients
    serve = result["serve"]
    assert serve["chat_completion_tokens"] == 4 and serve["chat_finish"] == "length"
    assert serve["stream_finish"] == "length" and serve["stream_chunks"] >= 2
    assert serve["clients"] == 2 and serve["requests"] == 4 and serve["requests_per_s"] > 0
    assert 0 < serve["latency_p50_s"] <= serve["latency_p99_s"] and serve["max_len"] == 64
    md = out.with_suffix(".md").read_text()
    assert "| gpt-oss-20b-tiny |" in md and "peak RSS" in md
    assert f"read {result['read_gbps']:.1f} GB/s with {result['read_threads']} threads" in md


def test_rows_of_other_models_are_kept_across_the_read_bandwidth_setting(tmp_path):
    """Re-measuring one model keeps the others' rows when only `read_mib` (the read-bandwidth buffer, which
    earlier rows did not measure) differs; any other setting drops them."""
    settings = real_size.Settings()
    now = json.loads(json.dumps(dataclasses.asdict(settings)))
    before = {k: v for k, v in now.items() if k != "read_mib"}
    out = tmp_path / "real_size_cpu.json"
    other = {"model": "qwen3-30b-a3b-half", "decode": {}}
    out.write_text(json.dumps({"settings": before, "machine": {"date": "d0"}, "results": [other]}))
    merged = real_size._merged(out, [{"model": "gpt-oss-20b"}], settings)
    assert [r["model"] for r in merged] == ["gpt-oss-20b", "qwen3-30b-a3b-half"] and merged[1]["date"] == "d0"
    out.write_text(json.dumps({"settings": dict(before, prompt_len=7), "results": [other]}))
    assert [r["model"] for r in real_size._merged(out, [{"model": "gpt-oss-20b"}], settings)] == ["gpt-oss-20b"]
