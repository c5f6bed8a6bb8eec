"""Serving and input hardening: sampling parameters are validated once (`tutel_jax.serving._sampling`) for the
library's generate, the continuous batcher, `tutel-jax generate` and the server; non-finite logits stop generation
with a clear error (the server answers 500 and keeps serving); every CLI error is one line with exit code 2, flags
take dashes or underscores, and the help of each command names it (qwen3_moe fixture: 128 positions, 128 ids)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tutel_jax.cli import main
from tutel_jax.serving import generate
from support.paths import HF

FIXTURE = HF / "qwen3_moe"
CONTEXT = 128  # the fixture's max_position_embeddings


def _poisoned(model, token: int):
    """The model with the embedding row of `token` set to NaN: any sequence that feeds `token` gets non-finite
    logits from that position on; other sequences are untouched."""
    params = dict(model.params, embed=model.params["embed"].at[token].set(np.nan))
    return dataclasses.replace(model, params=params)


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("tutel-jax")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tutel_jax.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, check=False,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _one_line_error(err: str, prog: str) -> str:
    """The single stderr line of a CLI error (no usage block, no traceback)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


# ----------------------------------------------------------------------------------------- 1. sampling parameters

BAD_SAMPLING = [
    ({"temperature": -1.0}, "temperature", "-1.0"),
    ({"temperature": float("nan")}, "temperature", "nan"),
    ({"temperature": float("inf")}, "temperature", "inf"),
    ({"temperature": "hot"}, "temperature", "hot"),
    ({"top_p": 2.0}, "top_p", "2.0"),
    ({"top_p": 0.0}, "top_p", "0.0"),
    ({"top_p": float("nan")}, "top_p", "nan"),
    ({"top_k": -3}, "top_k", "-3"),
    ({"top_k": 2.5}, "top_k", "2.5"),
    ({"max_new_tokens": -1}, "max_new_tokens", "-1"),
    ({"max_new_tokens": 0}, "max_new_tokens", "0"),
    ({"max_new_tokens": True}, "max_new_tokens", "True"),
]


@pytest.mark.parametrize("bad,name,shown", BAD_SAMPLING)
def test_shared_validator_names_parameter_value_and_range(bad, name, shown):
    from tutel_jax.serving import check_sampling
    kw = {"max_new_tokens": 4, **bad}
    with pytest.raises(ValueError) as e:
        check_sampling(**kw)
    msg = str(e.value)
    assert name in msg and shown in msg, msg
    assert any(r in msg for r in (">= 0", "(0, 1]", ">= 1", "must be a number", "must be an integer")), msg
    assert e.value.param == name


def test_shared_validator_keeps_valid_values_and_checks_the_context():
    from tutel_jax.serving._sampling import check_sampling, model_context
    p = check_sampling(max_new_tokens=8, temperature=0.7, top_k=0, top_p=1.0)
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p) == (8, 0.7, 0, 1.0)
    p = check_sampling(max_new_tokens=np.int64(3), temperature=0, top_k=None, top_p=None)
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p) == (3, 0.0, None, None)
    assert check_sampling(max_new_tokens=8, prompt_length=120, context=128).max_new_tokens == 8
    with pytest.raises(ValueError, match=r"max_new_tokens.*9.*context of 128") as e:
        check_sampling(max_new_tokens=9, prompt_length=120, context=128)
    assert e.value.code == "context_length_exceeded"
    assert model_context({"max_position_embeddings": 128}) == 128 and model_context({}) is None


@pytest.mark.parametrize("bad,name,shown", [b for b in BAD_SAMPLING if b[1] != "max_new_tokens"] + [
    ({"max_new_tokens": -1}, "max_new_tokens", "-1"),
    ({"max_new_tokens": CONTEXT - 12 + 1}, "max_new_tokens", str(CONTEXT - 12 + 1)),  # beyond the context
])
def test_generate_rejects_what_the_server_refuses(model, prompts, bad, name, shown):
    kw = {"max_new_tokens": 4, **bad}
    n = kw.pop("max_new_tokens")
    for on_device in (False, True):
        with pytest.raises(ValueError) as e:
            generate(model, prompts, n, on_device=on_device, **kw)
        assert name in str(e.value) and shown in str(e.value), str(e.value)


def test_continuous_batcher_rejects_bad_sampling_and_the_model_context(model):
    from tutel_jax.serving._continuous import ContinuousBatcher, Request
    batcher = ContinuousBatcher(model, max_batch_size=1, max_len=256)  # slots beyond the model's 128 positions
    for bad in ({"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 2.0}, {"top_k": -3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            batcher.add(Request([1, 2, 3], 4, **bad))
    with pytest.raises(ValueError, match="context"):
        batcher.add(Request([1] * 100, 40))  # fits the cache row, not the model
    assert batcher.idle


def _app(model, **cfg):
    from tutel_jax.serving._server import ServerConfig, create_app
    return create_app(FIXTURE, ServerConfig(**cfg), model=model, warmup=False)


SERVER_BAD = [
    ({"temperature": -1}, "temperature", "invalid_value", "-1"),
    (b'{"prompt": [1, 2], "temperature": NaN}', "temperature", "invalid_value", "nan"),
    ({"temperature": 3.0}, "temperature", "invalid_value", "3.0"),  # the server's OpenAI cap of 2
    ({"top_p": 2.0}, "top_p", "invalid_value", "2.0"),
    ({"top_p": -0.5}, "top_p", "invalid_value", "-0.5"),
    (b'{"prompt": [1, 2], "top_p": Infinity}', "top_p", "invalid_value", "inf"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value", "0"),
    ({"max_tokens": 2.5}, "max_tokens", "invalid_type", "2.5"),
    ({"prompt": [1] * 100, "max_tokens": 40}, "max_tokens", "context_length_exceeded", "40"),
]


@pytest.mark.parametrize("batching", ["continuous", "bucketed"])
def test_server_refuses_with_the_shared_rules(model, batching):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tutel_jax.serving import _api_requests as api_requests, _sampling as sampling
    assert api_requests.check_sampling is sampling.check_sampling  # one set of rules, not a copy
    h = TestClient(_app(model, batching=batching))  # no lifespan: nothing is generated, only validated
    for body, param, code, shown in SERVER_BAD:
        content = body if isinstance(body, bytes) else json.dumps({"prompt": [1, 2], **body}).encode()
        r = h.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert (err["param"], err["code"]) == (param, code), (body, err)
        assert shown in err["message"], err


# ----------------------------------------------------------------------------------------- 2. non-finite logits

@pytest.fixture(scope="module")
def poisoned(model, prompts):
    """(model with NaN embedding row t, prompt row whose first greedy token is t, the clean greedy tokens)."""
    ref = generate(model, prompts, 4).tokens
    t = int(ref[0, 0])
    assert t not in prompts[0], "pick another prompt: its first token must be new"
    return _poisoned(model, t), t, ref


def test_generate_raises_on_non_finite_logits(poisoned, prompts):
    bad, t, _ = poisoned
    # the prompt is fine (step 0), the first sampled token feeds NaN: step 1 fails, in every generation path
    for kw in ({}, {"stream_callback": lambda s, toks: None}, {"stop_token_ids": [(t + 1) % 128]}, {"on_device": True}):
        with pytest.raises(FloatingPointError, match="non-finite logits at step 1"):
            generate(bad, prompts[:1], 4, **kw)
    # a prompt that holds the poisoned token fails at the prefill, before any callback sees a token
    seen = []
    with pytest.raises(FloatingPointError, match="non-finite logits at step 0"):
        generate(bad, np.array([[3, t, 5]]), 4, stream_callback=lambda s, toks: seen.append(s))
    assert seen == []


def test_continuous_batcher_fails_only_the_non_finite_request(poisoned, model):
    from tutel_jax.serving._continuous import ContinuousBatcher, Request
    bad, t, _ = poisoned
    good = [9, 8, 7]
    ref = generate(model, np.array([good]), 6).tokens[0].tolist()
    assert t not in ref + good
    batcher = ContinuousBatcher(bad, max_batch_size=1, max_len=32)  # one row: the good request reuses it
    # prefilled in a 32-slot bucket, its slots 18.. hold NaN; the good request's 16-slot prefill does not
    # overwrite them, and its attention must not pick them up
    failed, ok = Request([1] * 18 + [t], 6), Request(good, 6)
    batcher.add(failed)
    batcher.add(ok)
    done = []
    while not batcher.idle:
        done += batcher.step()
    assert failed.finished and failed.finish_reason == "error" and failed.tokens == []
    assert isinstance(failed.error, FloatingPointError) and "non-finite logits at step 0" in str(failed.error)
    assert ok.finish_reason == "length" and ok.tokens == ref and ok.error is None  # the NaN row left no trace
    assert done == [failed, ok]


@pytest.mark.parametrize("batching", ["continuous", "bucketed"])
def test_server_answers_500_on_non_finite_logits_and_keeps_serving(poisoned, model, prompts, batching):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    bad, t, _ = poisoned
    good = [9, 8, 7]
    ref = generate(model, np.array([good]), 4).tokens[0].tolist()
    assert t not in ref + good
    with TestClient(_app(bad, batching=batching, max_batch_size=1)) as h:
        # NaN at the prefill (slots 18.. of a 32-slot bucket), then at the first decode step
        for prompt in ([1] * 18 + [t], prompts[0].tolist()):
            r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "server_error" and err["code"] == "non_finite_logits", err
            assert "non-finite logits" in err["message"], err
            ok = h.post("/v1/completions", json={"prompt": good, "max_tokens": 4, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == ref, ok.text
        # streamed: the error arrives as an event in the OpenAI error shape
        with h.stream("POST", "/v1/completions", json={"prompt": [3, t], "max_tokens": 4, "temperature": 0,
                                                       "stream": True}) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        assert events[-1]["error"]["code"] == "non_finite_logits", events
        assert h.get("/health").json()["status"] == "ok"


def test_generate_command_reports_non_finite_logits_in_one_line(poisoned, monkeypatch, capsys):
    import tutel_jax.models
    bad, t, _ = poisoned
    monkeypatch.setattr(tutel_jax.models, "from_pretrained", lambda *a, **k: bad)
    assert main(["generate", str(FIXTURE), "--ids", f"3,{t},5", "--max-new-tokens", "4"]) == 2
    line = _one_line_error(capsys.readouterr().err, "tutel-jax generate")
    assert "non-finite logits at step 0" in line


# ----------------------------------------------------------------------------------------- 3. the command line

def test_generate_bad_max_new_tokens_is_one_line_in_a_subprocess():
    proc = _cli("generate", str(FIXTURE), "--ids", "1,2", "--max-new-tokens", "-1")
    assert proc.returncode == 2, proc.stderr
    line = _one_line_error(proc.stderr, "tutel-jax generate")
    assert "max_new_tokens" in line and "-1" in line and ">= 1" in line


@pytest.mark.parametrize("argv,shown", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "nan"),
    (["--top-p", "2"], "top_p"),
    (["--top_p", "0"], "top_p"),          # underscore spelling
    (["--top-k", "-3"], "top_k"),
    (["--max_new_tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", "x"], "'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--stream", "--on-device"], "--stream"),
])
def test_generate_argument_errors_are_one_line(argv, shown, capsys):
    with pytest.raises(SystemExit) as ex:
        main(["generate", str(FIXTURE), "--ids", "1,2", *argv])
    assert ex.value.code == 2
    assert shown in _one_line_error(capsys.readouterr().err, "tutel-jax generate")


def test_generate_beyond_the_context_is_one_line(capsys):
    # 12 + 117 > 128 positions: refused after loading the model, before generating
    assert main(["generate", str(FIXTURE), "--ids", ",".join(["1"] * 12), "--max-new-tokens", "117"]) == 2
    line = _one_line_error(capsys.readouterr().err, "tutel-jax generate")
    assert "context of 128" in line and "117" in line


def test_generate_errors_before_the_model_share_the_prefix(tmp_path, capsys):
    assert main(["generate", str(FIXTURE), "--prompt", "hello"]) == 2  # no tokenizer.json
    assert "tokenizer.json" in _one_line_error(capsys.readouterr().err, "tutel-jax generate")
    assert main(["generate", str(tmp_path), "--ids", "1,2"]) == 2  # no config.json
    assert "no config.json" in _one_line_error(capsys.readouterr().err, "tutel-jax generate")


def test_serve_truncated_checkpoint_is_one_line_in_a_subprocess(tmp_path):
    ckpt = tmp_path / "truncated"
    shutil.copytree(FIXTURE, ckpt)
    weights = ckpt / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    # underscore and dash spellings side by side
    proc = _cli("serve", str(ckpt), "--no_warmup", "--max_batch_size", "2", "--max-len", "64", "--port", "0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line_error(proc.stderr, "tutel-jax serve")
    assert "cannot load" in line and "truncated" in line


@pytest.mark.parametrize("argv,shown", [
    (["--max_batch_size", "0"], "--max-batch-size"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--max_len", "1"], "--max-len"),
    (["--port", "-5"], "--port"),
    (["--batch-wait-ms", "nan"], "--batch-wait-ms"),
    (["--log_level", "loud"], "--log-level"),
    (["--batching", "fifo"], "--batching"),
])
def test_serve_argument_errors_are_one_line(argv, shown, capsys, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the arguments were accepted"))
    with pytest.raises(SystemExit) as ex:
        main(["serve", str(FIXTURE), *argv])
    assert ex.value.code == 2
    assert shown in _one_line_error(capsys.readouterr().err, "tutel-jax serve")


def test_help_names_each_command_and_shows_dashed_flags(capsys):
    for command, dashed, underscored in (("serve", "--max-batch-size", "--max_batch_size"),
                                         ("generate", "--max-new-tokens", "--max_new_tokens")):
        with pytest.raises(SystemExit) as ex:
            main([command, "--help"])
        assert ex.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: tutel-jax {command} "), out[:200]
        options = out[out.index("options:"):]
        assert dashed in options and f"{underscored} " not in options.split("\n\n")[0], options
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("serve", "generate"):  # each command on one line, with what it does
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(command + " "))
        assert len(line.split()) > 3, out


def test_top_level_errors_are_one_line(capsys):
    assert main([]) == 2
    assert "command" in _one_line_error(capsys.readouterr().err, "tutel-jax")
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in _one_line_error(capsys.readouterr().err, "tutel-jax")
