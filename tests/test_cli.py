"""The `tutel-jax` command (installed entry point): usage, generate (token ids or text prompts, streamed or not),
and clear errors for unknown commands and bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tutel_jax.cli import main
from support.paths import HF



def test_commands_come_from_their_packages_without_the_server_stack():
    """The command line takes each command from its package's API; loading them (and `tutel_jax.serving`) imports
    no FastAPI, uvicorn or Orbax: the server's stack is imported only when it serves."""
    code = ("import sys, tutel_jax.cli as c, tutel_jax.serving as s, tutel_jax.compile as k; "
            "assert c.serve is s.serve_main and c.generate is s.generate_main and c.compile_main is k.main; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'orbax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0 and "serve" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


def test_generate_command_in_a_subprocess():
    e = np.load(HF / "qwen3_moe" / "expected.npz")
    prompt = ",".join(str(t) for t in e["input_ids"][0])
    exe = Path(sys.executable).with_name("tutel-jax")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tutel_jax.cli"]
    proc = subprocess.run(cmd + ["generate", str(HF / "qwen3_moe"), "--ids", prompt, "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"-> {e['greedy'][0, 12:].tolist()}" in proc.stdout


def _with_tokenizer(tmp_path: Path) -> Path:
    """A copy of the qwen3_moe fixture with a word-level tokenizer.json: token i is the word 't{i}'."""
    tokenizers = pytest.importorskip("tokenizers")
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        (tmp_path / f).symlink_to(HF / "qwen3_moe" / f)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_generate_text_prompt_streamed(tmp_path, capsys):
    ckpt = _with_tokenizer(tmp_path)
    e = np.load(HF / "qwen3_moe" / "expected.npz")
    prompt = " ".join(f"t{t}" for t in e["input_ids"][0])
    ref = " ".join(f"t{t}" for t in e["greedy"][0, 12:])
    assert main(["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "8", "--stream"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ref  # the streamed text, as it arrived, then the summary
    assert lines[1] == f"prompt 0: {prompt!r} -> {ref!r}"


def test_generate_ids_streamed_with_stop_tokens(capsys):
    e = np.load(HF / "qwen3_moe" / "expected.npz")
    greedy = e["greedy"][:, 12:].tolist()
    stops = [greedy[0][2], greedy[1][3]]  # each row ends by its 4th token: fewer steps than 8

    def cut(row):
        return row[:min(row.index(s) + 1 for s in stops if s in row)]

    argv = ["generate", str(HF / "qwen3_moe"), "--max-new-tokens", "8", "--stream",
            "--stop-token-ids", ",".join(map(str, stops))]
    for row in e["input_ids"]:
        argv += ["--ids", ",".join(map(str, row))]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == max(len(cut(row)) for row in greedy) < 8  # one line per step, until both rows finished
    assert steps[0] == f"step 0: [0] '{greedy[0][0]} '  [1] '{greedy[1][0]} '"
    for b in range(2):
        assert f"prompt {b}: {e['input_ids'][b].tolist()} -> {cut(greedy[b])}" in lines


def test_generate_argument_errors(tmp_path, capsys):
    # --prompt without a tokenizer.json: an error naming the file (before the model is loaded)
    assert main(["generate", str(HF / "qwen3_moe"), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert str(HF / "qwen3_moe" / "tokenizer.json") in err and "not found" in err
    for argv in (["--ids", "1,2", "--prompt", "hello"], []):  # exactly one of --ids / --prompt
        with pytest.raises(SystemExit) as ex:
            main(["generate", str(HF / "qwen3_moe"), *argv])
        assert ex.value.code == 2
    assert "one of the arguments --ids --prompt is required" in capsys.readouterr().err


def test_generate_bad_checkpoint_is_one_line_and_quantized_memory_is_reported(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--ids", "1,2"]) == 2  # no config.json
    err = capsys.readouterr().err
    assert err.startswith("tutel-jax generate: error: cannot load") and "no config.json" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["generate", str(HF / "qwen3_moe_nvfp4"), "--ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert "(nvfp4) = 0.28" in capsys.readouterr().out
