"""tutel-jax against llama.cpp on one CPU: the same generated checkpoint, the same threads, side by side.

    python benchmarks/vs_llamacpp.py [--model gpt-oss-20b] [--threads N] [--rounds 3] [--work-dir D]
    python benchmarks/vs_llamacpp.py --quick      # the CI smoke test: the tutel-jax half on the tiny layout

Every step is cached in --work-dir (default `vs_llamacpp` in tutel-jax's user cache, `core.user_cache_dir`,
outside the repository):
  llama.cpp   the `llama-cpp-python` source distribution at LLAMA_CPP_PYTHON (from the package registry; it
              vendors llama.cpp, whose commit its changelog names), built with cmake + ninja and
              `-DGGML_NATIVE=ON`: llama-bench, llama-batched-bench and llama-server;
  converter   a virtual environment with llama.cpp's converter requirements (PyTorch CPU, transformers,
              sentencepiece, protobuf, the vendored gguf-py);
  checkpoint  `benchmarks/make_real_size.py`'s model (random weights in the released layout);
  GGUF        llama.cpp's own `convert_hf_to_gguf.py`, unpatched, on a view of the checkpoint (its files linked)
              whose tokenizer is GPT-2's BPE vocabulary read from llama.cpp's own `models/ggml-vocab-gpt-2.gguf`:
              the converter identifies a BPE pre-tokenizer by hashing its tokens of a test text, and knows
              GPT-2's. Neither benchmark tokenizes text, so the vocabulary changes no number.
  rounds      interleaved, --rounds of them: llama.cpp (llama-bench: `-p 512` prefill and `-n 64` decode at
              batch 1, from an empty cache; llama-batched-bench: 8 parallel sequences of 16-token prompts for
              decode at batch 8), then tutel-jax (one child process: `from_pretrained(dtype=bfloat16)` (its
              defaults: on this CPU compact bfloat16 dense weights where the build has bfloat16 dot products), a
              512-token prefill, then 64 greedy decode steps at batch 1 and 16 at batch 8 after 16-token prompts,
              after compiling runs). Both run pinned to the same --threads CPUs
              (llama.cpp with `-t` threads, XLA's pool on those CPUs), with the same environment. Each child's
              peak RSS comes from wait4.
  serving     after the rounds, once each: `tutel-jax serve` (`real_size.measure_serving`: continuous batching of
              4 rows, 256 slots each) and llama.cpp's `llama-server` (`-np 4`, a 1024-token context: 256 per
              slot) under the same load: 4 concurrent clients send 8 completions of 8 greedy tokens after 16-token
              prompts (random ids below 256, in both vocabularies) to /v1/completions; req/s, tokens/s and p50 /
              p99 latency (`benchmarks/serve.timed_load`, one untimed level first). `--serving-only` measures this
              alone and adds it to an existing results file of the same model.
The read bandwidth is `tutel_jax.native.ReadProbe` with the same threads (a 1 GiB buffer, each thread's stream
prefetched as the kernels prefetch theirs), measured in each tutel-jax round's process between decode steps: after
its batch-1 decode, 64 more batch-1 steps (after a 16-token prompt) each followed by a read, the best of two
passes (`real_size.paired_roofline`). A shared machine's bandwidth moves by 2x within minutes, so a decode speed
is set against the bandwidth of its own moments: `roofline_b1` = the bytes tutel-jax reads per decode step at
batch 1 (`real_size.decode_bytes`) x the tok/s of those paired steps (`roofline_b1_tok_s`, the median step) / the
median of their reads (`read_bandwidth_bytes_per_s`). Medians over rounds (each round's figures are kept).
Writes benchmarks/results/vs_llamacpp.{json,md} (--quick: --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, markdown_table, write_json, write_text  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # its changelog names the vendored llama.cpp commit
CONVERTER_REQUIREMENTS = ("torch==2.13.0+cpu", "transformers", "sentencepiece", "protobuf<5", "safetensors", "numpy")
PROMPT, DECODE_B1, DECODE_B8, BATCH = 512, 64, 16, 8
SHORT_PROMPT = 16  # the prompt of the decode runs (each of the batch-8 rows, in both systems)
QUICK_PROMPT, QUICK_DECODE = 32, 4
METRICS = ("decode_b1_tok_s", "prefill_512_tok_s", "decode_b8_tok_s", "peak_rss_bytes", "load_seconds")
SERVE_CLIENTS, SERVE_REQUESTS, SERVE_MAX_TOKENS, SERVE_PROMPT, SERVE_SLOT_LEN = 4, 8, 8, 16, 256
LLAMA_TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")


def default_work_dir() -> Path:
    from tutel_jax.core import user_cache_dir

    return user_cache_dir() / "vs_llamacpp"


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


# ----------------------------------------------------------------------------------------------- llama.cpp


def llama_cpp_source(work: Path) -> tuple[Path, str]:
    """(the vendored llama.cpp directory, its commit) of the pinned llama-cpp-python sdist, downloaded once."""
    src = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not src.exists():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(work),
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}"])
        with tarfile.open(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(work, filter="data")
    changelog = (src / "CHANGELOG.md").read_text()
    section = changelog.split(f"## [{LLAMA_CPP_PYTHON}]", 1)[1].split("\n## [", 1)[0]
    match = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    if match is None:
        raise RuntimeError(f"the changelog of llama-cpp-python {LLAMA_CPP_PYTHON} names no llama.cpp commit")
    return src / "vendor" / "llama.cpp", match.group(1)


def build_llama_cpp(work: Path, llama: Path, commit: str) -> Path:
    """The directory of the built LLAMA_TOOLS (built once)."""
    build = work / "build"
    if not all((build / "bin" / tool).exists() for tool in LLAMA_TOOLS):
        if not (build / "build.ninja").exists():
            _run(["cmake", "-S", str(llama), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                  "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", f"-DLLAMA_BUILD_COMMIT={commit}"])
        _run(["ninja", "-C", str(build), *LLAMA_TOOLS])
    return build / "bin"


def converter_python(work: Path, llama: Path) -> Path:
    """The Python of the converter's virtual environment (made once)."""
    venv = work / "converter-venv"
    python = venv / "bin" / "python"
    if not (venv / "done").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(python), "-m", "pip", "install", "-q", *CONVERTER_REQUIREMENTS, str(llama / "gguf-py")])
        (venv / "done").write_text("")
    return python


_GPT2_TOKENIZER = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
fields = GGUFReader(sys.argv[1] + "/models/ggml-vocab-gpt-2.gguf").fields
def strings(name):
    return [bytes(fields[name].parts[i]).decode("utf-8") for i in fields[name].data]
vocab = {t: i for i, t in enumerate(strings("tokenizer.ggml.tokens"))}
merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
tok.save(sys.argv[2] + "/tokenizer.json")
json.dump({"tokenizer_class": "GPT2TokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
          open(sys.argv[2] + "/tokenizer_config.json", "w"))
"""


def convert_to_gguf(work: Path, llama: Path, python: Path, model_dir: Path) -> Path:
    """model_dir converted by llama.cpp's converter (module docstring), once: the GGUF file."""
    out = work / f"{model_dir.name}.gguf"
    if out.exists():
        return out
    view = work / f"{model_dir.name}-view"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for f in model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (view / f.name).symlink_to(f.resolve())
    _run([str(python), "-c", _GPT2_TOKENIZER, str(llama), str(view)])
    partial = out.with_suffix(".partial")
    _run([str(python), str(llama / "convert_hf_to_gguf.py"), str(view), "--outfile", str(partial)])
    partial.rename(out)
    return out


# ------------------------------------------------------------------------------------------- measurement


def _pinned(cpus: list[int]):
    return lambda: os.sched_setaffinity(0, cpus)


def run_child(cmd: list[str], cpus: list[int], env: dict[str, str], timeout: float) -> tuple[str, str, int]:
    """(stdout, stderr, peak RSS bytes from wait4) of a child pinned to `cpus`; RuntimeError when it fails or
    runs past `timeout` seconds (it is killed then)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, preexec_fn=_pinned(cpus))
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise RuntimeError(f"{Path(cmd[0]).name} did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return stdout, stderr, usage.ru_maxrss * 1024


def llama_cpp_round(bin_dir: Path, gguf: Path, threads: int, cpus: list[int], env: dict[str, str]) -> dict:
    """One round of llama.cpp: llama-bench (prefill 512, decode 64 at batch 1), llama-batched-bench (decode at
    batch 8) and a load-only llama-bench run (its wall time less one token's evaluation: the load); peak RSS the
    largest of the children's (the model is mapped: mapped pages that were read count, as for any process)."""
    env = dict(env, LD_LIBRARY_PATH=str(bin_dir))
    bench, _, rss_a = run_child([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(PROMPT),
                                 "-n", str(DECODE_B1), "-r", "1", "-o", "json"], cpus, env, 3600)
    rows = json.loads(bench)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] == PROMPT and r["n_gen"] == 0)
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] == DECODE_B1 and r["n_prompt"] == 0)
    batched, _, rss_b = run_child([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
                                     "-c", "4096", "-b", "512", "-ub", "512", "-npp", str(SHORT_PROMPT),
                                     "-ntg", str(DECODE_B1), "-npl", str(BATCH), "--output-format", "jsonl"],
                                    cpus, env, 3600)
    row = json.loads([line for line in batched.splitlines() if line.startswith("{")][-1])
    # load: the wall time of a run that only loads the model and evaluates one token, less that evaluation
    start = time.perf_counter()
    one, _, rss_c = run_child([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "1", "-n", "0",
                               "-r", "1", "--no-warmup", "-o", "json"], cpus, env, 3600)
    load = time.perf_counter() - start - json.loads(one)[0]["avg_ns"] / 1e9
    return {"decode_b1_tok_s": decode, "prefill_512_tok_s": prefill, "decode_b8_tok_s": row["speed_tg"],
            "peak_rss_bytes": max(rss_a, rss_b, rss_c), "load_seconds": load, "commit": rows[0].get("build_commit")}


def tutel_jax_round(model_dir: Path, cpus: list[int], env: dict[str, str], quick: bool) -> dict:
    """One round of tutel-jax in a fresh child process (`--child`)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model_dir)] + (["--quick"] if quick else [])
    out, _, rss = run_child(cmd, cpus, env, 7200)
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_bytes"] = rss
    return result


def read_bandwidth_bytes(quick: bool) -> int:
    """The read-bandwidth buffer: larger than any cache (the smoke test's: small)."""
    return (32 if quick else 1024) << 20


def child(model_dir: Path, quick: bool) -> dict:
    """In the child: load, then prefill and decode speeds (module docstring); prints one JSON line."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.real_size import Decoder, decode_bytes, paired_roofline
    from tutel_jax import native
    from tutel_jax.experts import resolve_impl
    from tutel_jax.models import from_pretrained
    from tutel_jax.native import CompactBf16, ReadProbe

    prompt, steps_b1, steps_b8 = (QUICK_PROMPT, QUICK_DECODE, QUICK_DECODE) if quick else (PROMPT, DECODE_B1,
                                                                                         DECODE_B8)
    start = time.perf_counter()
    model = from_pretrained(model_dir, dtype=jnp.bfloat16, progress=False)
    load_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    dec = Decoder(model, prompt + steps_b1 + 8)
    ids = rng.integers(0, model.spec.vocab_size, (1, prompt))
    dec.run(ids, 1)  # compiles the prefill and the step at batch 1
    ttft = dec.run(ids, 0)[0]
    # batch-1 decode from a short prompt (llama-bench's `-n` decodes from an empty cache)
    short = ids[:, :SHORT_PROMPT]
    dec.run(short, 0)  # compiles its prefill
    _, times_b1, _ = dec.run(short, steps_b1)
    bytes_b1 = decode_bytes(model, 1)
    # the roofline: as many batch-1 steps again, each followed by a read of the probe's buffer
    probe = ReadProbe(read_bandwidth_bytes(quick), len(os.sched_getaffinity(0)))
    roof = paired_roofline(dec, short, steps_b1, probe, bytes_b1)
    del probe
    ids8 = rng.integers(0, model.spec.vocab_size, (BATCH, SHORT_PROMPT))
    dec.run(ids8, 1)
    _, times_b8, _ = dec.run(ids8, steps_b8)
    return {"decode_b1_tok_s": 1 / statistics.median(times_b1), "prefill_512_tok_s": prompt / ttft,
            "decode_b8_tok_s": BATCH / statistics.median(times_b8), "load_seconds": load_s,
            "bytes_per_step_b1": bytes_b1, "read_bandwidth_bytes_per_s": roof["read_bytes_per_s"],
            "roofline_b1_tok_s": 1 / roof["step_s"], "roofline_b1": roof["roofline"], "prompt_len": prompt,
            "isa": native.isa(),
            "expert_path": resolve_impl("auto", model.moe_configs[0].experts),
            "dense_weights": "compact_bf16" if isinstance(model.params.get("lm_head"), CompactBf16) else "bfloat16"}


# ------------------------------------------------------------------------------------------------ report


def llama_cpp_serving(bin_dir: Path, gguf: Path, threads: int, cpus: list[int], env: dict[str, str]) -> dict:
    """`llama-server` (SERVE_CLIENTS parallel slots of SERVE_SLOT_LEN tokens) under the serving load."""
    from benchmarks.serve import free_port, stop_server, timed_load, wait_healthy

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-np", str(SERVE_CLIENTS),
           "-c", str(SERVE_CLIENTS * SERVE_SLOT_LEN), "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, text=True, env=env, preexec_fn=_pinned(cpus))
        try:
            start = time.perf_counter()
            try:
                wait_healthy(proc, base, 900)
            except RuntimeError as e:
                log.seek(0)
                raise RuntimeError(f"llama-server: {e}: {log.read()[-2000:]}") from None
            return {"startup_s": time.perf_counter() - start,
                    **timed_load(base, SERVE_CLIENTS, SERVE_REQUESTS, SERVE_MAX_TOKENS, SERVE_PROMPT)}
        finally:
            stop_server(proc, timeout=30)


def tutel_jax_serving(model_dir: Path) -> dict:
    """`tutel-jax serve` under the serving load (`real_size.measure_serving`, which also checks the openai
    client's chat completions first)."""
    from benchmarks.real_size import Settings, measure_serving

    out = measure_serving(model_dir, Settings(serve_clients=SERVE_CLIENTS, serve_requests=SERVE_REQUESTS,
                                              serve_max_tokens=SERVE_MAX_TOKENS, serve_max_len=SERVE_SLOT_LEN))
    keys = ("startup_s", "requests_per_s", "tokens_per_s", "wall_s", "latency_p50_s", "latency_p99_s")
    return {k: out[k] for k in keys}


def serving_result(model_dir: Path, bin_dir: Path, gguf: Path, threads: int, cpus: list[int],
                   env: dict[str, str]) -> dict:
    load = {"clients": SERVE_CLIENTS, "requests": SERVE_REQUESTS, "max_tokens": SERVE_MAX_TOKENS,
            "prompt_tokens": SERVE_PROMPT, "slot_len": SERVE_SLOT_LEN}
    return {**load, "tutel_jax": tutel_jax_serving(model_dir),
            "llama_cpp": llama_cpp_serving(bin_dir, gguf, threads, cpus, env)}


def medians(rounds: list[dict]) -> dict:
    out = {}
    for key in METRICS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def markdown(result: dict) -> str:
    ll, tj = result.get("llama_cpp"), result["tutel_jax"]
    rows = []
    labels = (("decode_b1_tok_s", "decode, batch 1 (tok/s)"),
              ("prefill_512_tok_s", f"prefill, {result['prompt_len']} tokens (tok/s)"),
              ("decode_b8_tok_s", f"decode, batch {BATCH} (tok/s)"), ("peak_rss_bytes", "peak RSS (GiB)"),
              ("load_seconds", "load (s)"))
    for key, label in labels:
        scale = 1 / 2 ** 30 if key == "peak_rss_bytes" else 1
        cell = lambda v: "n/a" if v is None else f"{v * scale:.2f}"  # noqa: E731
        ratio = "" if not ll or not ll.get(key) or tj.get(key) is None else f"{tj[key] / ll[key]:.2f}x"
        rows.append([label, cell(tj.get(key)), cell(ll.get(key)) if ll else "not run", ratio])
    table = markdown_table(["", "tutel-jax", "llama.cpp", "tutel-jax / llama.cpp"], rows)
    head = (f"{result['model']}, {result['threads']} threads, {result['rounds']} interleaved rounds (medians), "
            f"llama.cpp {result.get('llama_cpp', {}).get('commit', 'not run')}. Read bandwidth "
            f"{result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({result['read_bandwidth_method']}); tutel-jax "
            f"reads {tj['bytes_per_step_b1'] / 1e9:.2f} GB per decode step at batch 1: roofline_b1 "
            f"{tj['roofline_b1']:.2f}. tutel-jax's native kernels: {tj.get('isa', 'not recorded')}, experts "
            f"{tj.get('expert_path', 'native')}, dense weights {tj.get('dense_weights', 'bfloat16')}.")
    text = f"{head}\n\n{table}\n"
    serving = result.get("serving")
    if serving:
        rows = []
        for name, key in (("tutel-jax serve", "tutel_jax"), ("llama.cpp llama-server", "llama_cpp")):
            r = serving[key]
            rows.append([name, f"{r['requests_per_s']:.2f}", f"{r['tokens_per_s']:.2f}",
                         f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f}"])
        text += (f"\nServing: {serving['clients']} concurrent clients, {serving['requests']} completions of "
                 f"{serving['max_tokens']} greedy tokens after {serving['prompt_tokens']}-token prompts "
                 f"(/v1/completions), {serving['clients']} slots of {serving['slot_len']} tokens.\n\n"
                 + markdown_table(["server", "req/s", "tokens/s", "p50 / p99 latency (s)"], rows, "lrrr"))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-oss-20b", help="a benchmarks/make_real_size.py model")
    parser.add_argument("--threads", type=int, default=None, help="default: this process's usable CPUs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="the tiny layout, tutel-jax only (the CI smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_llamacpp.json")
    parser.add_argument("--serving-only", action="store_true",
                        help="measure the serving comparison alone and add it to the --out file of the same model")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.quick)))
        return 0
    if args.serving_only and args.quick:
        parser.error("--serving-only needs llama.cpp: not with --quick")
    if args.serving_only:
        try:
            previous = json.loads(args.out.read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--serving-only adds to an existing results file: {args.out}: {e}")
        if previous.get("model") != args.model:
            parser.error(f"--serving-only: {args.out} holds {previous.get('model')!r}, not {args.model!r}")

    from benchmarks import make_real_size
    from tutel_jax.core import usable_cpus

    model = f"{args.model}-tiny" if args.quick and not args.model.endswith("-tiny") else args.model
    cpus = sorted(os.sched_getaffinity(0))[: args.threads or usable_cpus()]
    threads = len(cpus)
    work = args.work_dir or default_work_dir()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_real_size.make_model(model, work / "checkpoints", progress=not args.quick)
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    if args.quick:
        bin_dir = gguf = commit = None
    else:
        llama, commit = llama_cpp_source(work)
        bin_dir = build_llama_cpp(work, llama, commit)
        gguf = convert_to_gguf(work, llama, converter_python(work, llama), model_dir)
    if args.serving_only:
        previous["serving"] = serving_result(model_dir, bin_dir, gguf, threads, cpus, env)
        write_json(args.out, previous)
        write_text(args.out.with_suffix(".md"), markdown(previous))
        print(markdown(previous))
        return 0
    rounds_ll, rounds_tj = [], []
    for i in range(args.rounds):  # interleaved: each system sees the machine in the same state, round by round
        if gguf is not None:
            rounds_ll.append(llama_cpp_round(bin_dir, gguf, threads, cpus, env))
        rounds_tj.append(tutel_jax_round(model_dir, cpus, env, args.quick))
        print(f"round {i + 1}: tutel-jax {rounds_tj[-1]['decode_b1_tok_s']:.2f} tok/s"
              + (f", llama.cpp {rounds_ll[-1]['decode_b1_tok_s']:.2f} tok/s" if rounds_ll else ""), flush=True)
    tj = medians(rounds_tj)
    tj["bytes_per_step_b1"] = rounds_tj[0]["bytes_per_step_b1"]
    tj["isa"] = rounds_tj[0]["isa"]  # the native kernels' instruction set
    tj["expert_path"] = rounds_tj[0]["expert_path"]  # the default dropless path (native_int8: int8 activations)
    tj["dense_weights"] = rounds_tj[0]["dense_weights"]  # the default layout of the dense weights (compact_bf16)
    for key in ("roofline_b1", "roofline_b1_tok_s"):
        tj[key] = statistics.median(r[key] for r in rounds_tj)
    bandwidth = statistics.median(r["read_bandwidth_bytes_per_s"] for r in rounds_tj)
    result = {"model": model, "threads": threads, "rounds": args.rounds, "read_bandwidth_bytes_per_s": bandwidth,
              "read_bandwidth_method": f"tutel_jax.native.ReadProbe: {threads} threads, "
                                       f"{read_bandwidth_bytes(args.quick) >> 20} MiB buffer, software prefetch 8 "
                                       "and 16 KB ahead; a read (the best of 2 passes) after each of the batch-1 "
                                       "decode steps of the roofline (the median of a round's reads), median over "
                                       "rounds",
              "prompt_len": rounds_tj[0]["prompt_len"], "tutel_jax": tj, "tutel_jax_rounds": rounds_tj,
              "machine": machine_info()}
    if rounds_ll:
        result["llama_cpp"] = {**medians(rounds_ll), "commit": commit}
        result["llama_cpp_rounds"] = rounds_ll
        result["serving"] = serving_result(model_dir, bin_dir, gguf, threads, cpus, env)
    write_json(args.out, result)
    write_text(args.out.with_suffix(".md"), markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
