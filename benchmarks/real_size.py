"""Real-size MoE checkpoints on this machine: load, memory, compile time against depth, TTFT and decode speed
against the memory roofline.

    python benchmarks/make_real_size.py gpt-oss-20b          # once: the checkpoint (~13.8 GB, outside the repo)
    python benchmarks/real_size.py [--models gpt-oss-20b ...] [--cache-dir D] [--quick] [--out F.json]

Each model runs in its own child process (so its peak RSS is its own), alone, in this order:
  disk    the shards' bytes read once from a cold page cache (`posix_fadvise(DONTNEED)` first), GB/s;
  load    `from_pretrained(dtype=bfloat16)` from a cold page cache again: seconds, resident bytes
          (`memory_report(model).total_bytes`) and the process's peak RSS (VmHWM), against the bound
          1.15 x resident + 1 GiB;
  compile the one-token decode step (KV cache of --max-len) for the first 4, 12 and 24 layers (as many as the
          model has), seconds: with the model's per-layer programs (a cold step minus a warm one), and as one
          whole-model jitted program (lowered and compiled) for comparison;
  TTFT    a --prompt-len prompt (random ids, batch 1): prefill + the first greedy token, after a compiling run;
  decode  --decode-steps greedy steps at batch 1 and 8 after a compiling one: tokens/s;
  read    the streaming read bandwidth with the process's CPUs as threads (`native.ReadProbe`: a 1 GiB buffer,
          prefetched as the kernels prefetch), with the model resident: a read (the best of 2 passes) after each
          of --decode-steps more decode steps at each batch (`paired_roofline`: the bandwidth at the moments the
          steps run; the reads' median); also a copy bandwidth (np.copyto of 256 MiB buffers, one thread,
          STREAM's convention: bytes read + written per second), for comparison;
  roofline  bytes read per decode step / step time / read bandwidth, the steps and reads of those paired runs
          (medians; the copy ratio: the decode run's steps). Bytes per step: every non-expert weight
          (attention, norms, routers, lm_head; the embedding's B rows; MLA's absorbed kv_b_proj halves in place
          of kv_b_proj), plus each MoE layer's used experts:
          E * (1 - (1 - k/E)^B) of them on average (uniform routing, which random weights give).
  serve   after the child has exited: `tutel-jax serve` (bfloat16, --max-len slots per row) answers the
          official `openai` client (a chat completion, then a streamed one), then a few concurrent clients send
          completions: req/s and p50 / p99 latency (`measure_serving`).
`--quick` runs the `-tiny` variants (a few MB; generated into the cache directory when missing) with a short
prompt: the CI smoke test. Results: benchmarks/results/real_size_cpu.{json,md}; results there for other models,
measured with the same settings, are kept (each row says its date).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import machine_info, markdown_table, repo_root, write_json, write_text  # noqa: E402

DEFAULT_OUT = repo_root() / "benchmarks" / "results" / "real_size_cpu.json"
FULL_MODELS = ("gpt-oss-20b", "qwen3-30b-a3b-half", "deepseek-v3-layer")
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the child process measures (see the module docstring)."""

    prompt_len: int = 512
    decode_steps: int = 4
    batches: tuple[int, ...] = (1, 8)
    depths: tuple[int, ...] = (4, 12, 24)
    max_len: int = 1024
    copy_mib: int = 256
    read_mib: int = 1024
    serve_clients: int = 4        # concurrent clients of the serving run (0: no serving run)
    serve_requests: int = 8
    serve_max_tokens: int = 8
    serve_max_len: int = 256      # the server's --max-len: KV cache slots per row
    per_layer_jit: str = "auto"   # from_pretrained's and the server's ('auto', 'on', 'off')


# (the tiny models are shallower than per_layer_jit's 'auto' threshold: 'on' runs the real models' path)
QUICK = Settings(prompt_len=32, decode_steps=2, depths=(1, 2, 4), max_len=64, copy_mib=32, read_mib=32,
                 serve_clients=2, serve_requests=4, serve_max_tokens=4, serve_max_len=64, per_layer_jit="on")


# ----------------------------------------------------------------------------------------- child measurements

def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _drop_page_cache(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_gbps(files: list[Path]) -> tuple[float, int]:
    """(GB/s, bytes) of reading `files` once, from a cold page cache, into one reused 64 MiB buffer."""
    _drop_page_cache(files)
    buf, total = bytearray(64 << 20), 0
    start = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while (n := f.readinto(buf)):
                total += n
    seconds = time.perf_counter() - start
    _drop_page_cache(files)
    return total / seconds / 1e9, total


def copy_gbps(mib: int) -> float:
    """STREAM-copy bandwidth (read + written bytes per second) of np.copyto on `mib` MiB buffers, best of 5."""
    src = np.ones(mib << 18, np.float32)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def _truncated(model: Any, depth: int, per_layer_jit: bool | None = None) -> Any:
    """The model's first `depth` layers as a CausalLM (same arrays, nothing copied); per_layer_jit None: the
    model's."""
    from tutel_jax.models import CausalLM
    from tutel_jax.models import spec_from_config

    config = dict(model.config, num_hidden_layers=depth)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:depth]
    params = dict(model.params, layers=model.params["layers"][:depth])
    spec = dataclasses.replace(spec_from_config(config), dense_impl=model.spec.dense_impl,
                               attention_impl=model.spec.attention_impl)
    return CausalLM(spec=spec, params=params, moe_configs=model.moe_configs[:depth], config=config,
                    dtype=model.dtype, per_layer_jit=model.per_layer_jit if per_layer_jit is None else per_layer_jit)


class Decoder:
    """Greedy prefill + decode steps over a static KV cache of `max_len` slots: the serving engine's own steps
    (`serving.steps.prefill_step` / `decode_step`: one jit each, or, for a model with per-layer programs, the
    steps unjitted around them)."""

    def __init__(self, model: Any, max_len: int):
        from tutel_jax.serving import decode_step, prefill_step

        self.model, self.max_len = model, max_len
        self._prefill, self._step = prefill_step, decode_step

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _greedy(batch: int) -> Any:
        """Greedy sampling parameters of `batch` rows (no logit bias: the plain program)."""
        from tutel_jax.serving import row_sampling, sampling_arrays, trim_bias
        return trim_bias(sampling_arrays([row_sampling(0, b, 0.0, None, None, None) for b in range(batch)]))

    def prefill(self, ids, cache):
        tok, _, _, cache = self._prefill(self.model.forward_fn, self.model.params, ids, cache,
                                        self._greedy(ids.shape[0]))
        return tok, cache

    def step(self, tok, index, cache):
        tok, _, _, cache = self._step(self.model.forward_fn, self.model.params, tok, index, np.int32(0), cache,
                                      self._greedy(tok.shape[0]))
        return tok, cache

    def run(self, ids: np.ndarray, steps: int, after_step: Callable[[], Any] | None = None
            ) -> tuple[float, list[float], np.ndarray]:
        """(prefill + first token seconds, each decode step's seconds, tokens [B, 1 + steps]); after_step is
        called after each timed step (outside its time), e.g. a `ReadProbe`'s read."""
        import jax
        import jax.numpy as jnp

        cache = self.model.init_cache(ids.shape[0], self.max_len)
        start = time.perf_counter()
        tok, cache = self.prefill(jnp.asarray(ids, jnp.int32), cache)
        tok.block_until_ready()
        ttft, toks, times = time.perf_counter() - start, [np.asarray(tok)], []
        for i in range(steps):
            start = time.perf_counter()
            tok, cache = self.step(tok, jnp.int32(ids.shape[1] + i), cache)
            toks.append(np.asarray(jax.block_until_ready(tok)))
            times.append(time.perf_counter() - start)
            if after_step is not None:
                after_step()
        return ttft, times, np.stack(toks, 1)

    def step_compile_s(self) -> float:
        """Seconds to compile the one-token decode step at batch 1: the whole jitted step lowered and compiled,
        or, with per-layer programs, a cold step (every jit cache cleared) minus a warm one."""
        import jax
        import jax.numpy as jnp

        if not self.model.per_layer_jit:
            cache = jax.eval_shape(lambda: self.model.init_cache(1, self.max_len))
            start = time.perf_counter()
            self._step.jitted.lower(self.model.forward_fn, self.model.params, jax.ShapeDtypeStruct((1,), jnp.int32),
                                     jax.ShapeDtypeStruct((), jnp.int32), jnp.int32(0), cache,
                                     self._greedy(1)).compile()
            return time.perf_counter() - start
        jax.clear_caches()
        tok, times = jnp.zeros((1,), jnp.int32), []
        for _ in range(2):
            cache = self.model.init_cache(1, self.max_len)
            jax.block_until_ready(cache)
            start = time.perf_counter()
            jax.block_until_ready(self.step(tok, jnp.int32(0), cache))
            times.append(time.perf_counter() - start)
        return times[0] - times[1]


def decode_bytes(model: Any, batch: int) -> float:
    """Bytes read by one decode step at `batch` (module docstring): non-expert weights (the embedding's rows
    only; an MLA layer's kv_b_proj not where the step reads its absorbed halves instead) plus the expected used
    experts of every MoE layer."""
    from tutel_jax.models._param_layout import ABSORBED_K
    from tutel_jax.quant import _weights as quant_weights

    params = model.params
    total = 0.0
    for name, value in params.items():
        if name == "embed":
            total += batch * value.nbytes / value.shape[0]
        elif name != "layers":
            total += quant_weights.resident_bytes(value)
    for layer, cfg in zip(params["layers"], model.moe_configs):
        for name, value in layer.items():
            if name == "attn" and ABSORBED_K in value:
                value = {k: v for k, v in value.items() if k != "kv_b_proj"}
            if name != "moe":
                total += quant_weights.resident_bytes(value)
                continue
            rest = {k: v for k, v in value.items() if k != "experts"}
            total += quant_weights.resident_bytes(rest)
            E, k = cfg.num_global_experts, cfg.gates[0].k
            used = E * (1 - (1 - k / E) ** batch)
            total += used * quant_weights.resident_bytes(value["experts"]) / E
    return total


def paired_roofline(dec: Decoder, ids: np.ndarray, steps: int, probe: Any, bytes_per_step: float,
                    reps: int = 2) -> dict[str, float]:
    """`steps` greedy decode steps after the prompts ids [B, T], each followed by a read of `probe`
    (`native.ReadProbe`: a buffer larger than any cache, the same threads; the best of `reps` passes): the
    bandwidth the host gives at the moments the steps run (on a shared host it moves by 2x within minutes, so a
    read taken at another moment is not the steps' roofline). Returns the steps' median seconds (`step_s`), the
    reads' median bytes per second (`read_bytes_per_s`) and `roofline` = bytes_per_step / step_s /
    read_bytes_per_s."""
    reads: list[float] = []
    _, times, _ = dec.run(ids, steps, after_step=lambda: reads.append(probe(reps)))
    step_s, read = float(np.median(times)), float(np.median(reads))
    return {"step_s": step_s, "read_bytes_per_s": read, "roofline": bytes_per_step / step_s / read}


def measure(model_dir: Path, settings: Settings) -> dict[str, Any]:
    """Every measurement of the module docstring for one checkpoint directory (run in a fresh process)."""
    import jax.numpy as jnp

    from tutel_jax.models import from_pretrained
    from tutel_jax.models import PER_LAYER_JIT_CHOICES
    from tutel_jax.models import memory_report
    from tutel_jax.core import usable_cpus
    from tutel_jax.native import ReadProbe

    files = sorted(model_dir.glob("*.safetensors"))
    out: dict[str, Any] = {"model": model_dir.name, "shards": len(files)}
    out["disk_gbps"], out["checkpoint_bytes"] = disk_read_gbps(files)
    out["disk_s"] = out["checkpoint_bytes"] / out["disk_gbps"] / 1e9
    rss_before = _status_kib("VmRSS")
    start = time.perf_counter()
    model = from_pretrained(model_dir, dtype=jnp.bfloat16, progress=False,
                            per_layer_jit=PER_LAYER_JIT_CHOICES[settings.per_layer_jit])
    out["load_s"] = time.perf_counter() - start
    report = memory_report(model)
    out.update(resident_bytes=report.total_bytes, expert_bytes=report.expert_bytes,
               rss_before_load_bytes=rss_before * 1024, peak_rss_load_bytes=_status_kib("VmHWM") * 1024)
    out["rss_bound_bytes"] = 1.15 * report.total_bytes + GiB
    out["rss_within_bound"] = out["peak_rss_load_bytes"] <= out["rss_bound_bytes"]

    compile_s, compile_whole_s = {}, {}
    # the depths the model has (a model shallower than all of them: its own depth)
    depths = [d for d in settings.depths if d <= model.spec.num_layers] or [model.spec.num_layers]
    for depth in depths:
        compile_s[depth] = Decoder(_truncated(model, depth), settings.max_len).step_compile_s()
        if model.per_layer_jit:  # what one whole-model program would take, for comparison
            whole = _truncated(model, depth, per_layer_jit=False)
            compile_whole_s[depth] = Decoder(whole, settings.max_len).step_compile_s()
    out["per_layer_jit"] = model.per_layer_jit
    out["compile_s"], out["compile_whole_s"] = compile_s, compile_whole_s

    rng = np.random.default_rng(0)
    vocab = model.spec.vocab_size
    dec = Decoder(model, settings.max_len)
    prompt = rng.integers(0, vocab, (1, settings.prompt_len))
    dec.run(prompt, 0)  # compiles the prefill
    out["ttft_s"] = dec.run(prompt, 0)[0]
    out["prompt_len"] = settings.prompt_len
    decode = {}
    for batch in settings.batches:
        ids = rng.integers(0, vocab, (batch, 16))
        dec.run(ids, 1)  # compiles both programs at this batch
        _, times, _ = dec.run(ids, settings.decode_steps)
        step_s = float(np.median(times))
        decode[batch] = {"step_s": step_s, "tokens_per_s": batch / step_s, "bytes_per_step": decode_bytes(model, batch)}
    out["decode"] = decode
    out["peak_rss_bytes"] = _status_kib("VmHWM") * 1024
    out["copy_gbps"] = copy_gbps(settings.copy_mib)
    out["read_threads"] = usable_cpus()
    probe = ReadProbe(settings.read_mib << 20, out["read_threads"])  # after the peak RSS: not counted there
    for batch, d in decode.items():
        paired = paired_roofline(dec, rng.integers(0, vocab, (batch, 16)), settings.decode_steps, probe,
                                 d["bytes_per_step"])
        d.update(roofline_step_s=paired["step_s"], read_gbps=paired["read_bytes_per_s"] / 1e9,
                 roofline_ratio=paired["roofline"])
        d["roofline_copy_ratio"] = d["bytes_per_step"] / d["step_s"] / (out["copy_gbps"] * 1e9)
    out["read_gbps"] = decode[settings.batches[0]]["read_gbps"]  # the table's: the first batch's reads
    out["expert_formats"] = list(report.formats)
    return out


def measure_serving(model_dir: Path, settings: Settings) -> dict[str, Any]:
    """`tutel-jax serve` on the checkpoint (bfloat16, KV cache of --max-len slots per row, continuous batching
    of up to serve_clients rows): one chat completion and one streamed one through the official `openai`
    client, then serve_clients concurrent clients sending serve_requests completions (16 random byte ids each,
    greedy, serve_max_tokens tokens): req/s, tokens/s, p50/p99 latency."""
    import openai

    from benchmarks.serve import start_server, stop_server, timed_load

    s = settings
    rows = [1 << i for i in range(s.serve_clients.bit_length()) if 1 << i <= s.serve_clients]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        start = time.perf_counter()
        proc, base = start_server(str(model_dir), s.serve_clients, 5.0, log, warm_batches=rows, warm_lens=(16,),
                                  max_tokens=s.serve_max_tokens, healthy_within_s=1800,
                                  extra_args=("--dtype", "bfloat16", "--max-len", str(s.serve_max_len),
                                              "--per-layer-jit", s.per_layer_jit))
        out: dict[str, Any] = {"startup_s": time.perf_counter() - start, "max_len": s.serve_max_len}
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600)
            messages = [{"role": "user", "content": "Hello"}]
            chat = client.chat.completions.create(model=model_dir.name, messages=messages,
                                                  max_tokens=s.serve_max_tokens, temperature=0)
            chunks = list(client.chat.completions.create(model=model_dir.name, messages=messages,
                                                         max_tokens=s.serve_max_tokens, temperature=0, stream=True))
            out.update(chat_completion_tokens=chat.usage.completion_tokens, chat_finish=chat.choices[0].finish_reason,
                       stream_chunks=len(chunks), stream_finish=chunks[-1].choices[0].finish_reason)
            out.update(clients=s.serve_clients, requests=s.serve_requests,
                       **timed_load(base, s.serve_clients, s.serve_requests, s.serve_max_tokens))
        finally:
            stop_server(proc)
    return out


# ------------------------------------------------------------------------------------------------------ driver

def _child(model_dir: Path, settings: Settings, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model_dir), "--child-out", str(result),
               "--settings", json.dumps(dataclasses.asdict(settings))]
        done = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
            raise RuntimeError(f"measuring {model_dir.name} failed (exit {done.returncode}):\n{tail}")
        return json.loads(result.read_text())


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _serve_cell(serve: dict[str, Any] | None) -> str:
    if not serve:
        return "-"
    return (f"{serve['clients']}, {serve['requests_per_s']:.2f}, {serve['latency_p50_s']:.2f} / "
            f"{serve['latency_p99_s']:.2f}")


def _roofline_cell(r: dict[str, Any], d1: dict[str, Any]) -> str:
    ratio = d1.get("roofline_ratio", float("nan"))
    return f"{ratio:.3f}" if "read_gbps" in r else f"{ratio:.3f} (copy)"


def _bandwidth_note(r: dict[str, Any]) -> str:
    if "read_gbps" in r:
        return f"{r['model']}: read {r['read_gbps']:.1f} GB/s with {r['read_threads']} threads"
    return f"{r['model']}: copy {r['copy_gbps']:.1f} GB/s"


def markdown(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    rows = []
    for r in results:
        d1, d8 = r["decode"].get("1", {}), r["decode"].get("8", {})
        whole = r.get("compile_whole_s") or {}
        compile_s = ", ".join(f"{k}: {v:.1f}" + (f" ({whole[k]:.1f})" if k in whole else "")
                              for k, v in r["compile_s"].items())
        rows.append([r["model"], _gb(r["resident_bytes"]), _gb(r["peak_rss_load_bytes"]),
                     f"{r['load_s']:.1f} ({r['disk_s']:.1f})", compile_s, f"{r['ttft_s']:.2f}",
                     f"{d1.get('tokens_per_s', float('nan')):.2f}", f"{d8.get('tokens_per_s', float('nan')):.2f}",
                     _roofline_cell(r, d1), _serve_cell(r.get("serve"))])
    table = markdown_table(["model", "resident GB", "peak RSS GB (load)", "load s (disk read s)",
                            "decode compile s by layers (one program)", f"TTFT s ({results[0]['prompt_len']} tokens)",
                            "decode tok/s b=1", "decode tok/s b=8", "roofline ratio b=1",
                            "serve: clients, req/s, p50 / p99 s"], rows)
    dates = ", ".join(f"{r['model']} {r.get('date', info.get('date'))}" for r in results)
    head = (f"Measured on {info.get('backend', 'cpu')} ({info.get('cpu_count')} CPUs), jax {info.get('jax_version')} "
            f"({dates}). bfloat16 dense weights, experts packed as stored. Roofline ratio: bytes read per "
            "decode step / step time / streaming read bandwidth, measured in the same run with the process's CPUs "
            "as threads (" + ", ".join(_bandwidth_note(r) for r in results) + "); a ratio marked (copy) is from "
            "an earlier run that measured only a one-thread copy bandwidth (read + written bytes), which "
            "understates what the cores can read.")
    checks = "; ".join(f"{r['model']}: peak RSS {_gb(r['peak_rss_load_bytes'])} GB "
                       f"{'<=' if r['rss_within_bound'] else '>'} bound {_gb(r['rss_bound_bytes'])} GB"
                       for r in results)
    head += (" Compile: the decode step with per-layer programs (`per_layer_jit`, what from_pretrained picks for "
             "these depths: one program per kind of block of layers), in parentheses the same step as one "
             "whole-model program.")
    return f"{head}\n\n{table}\n\nLoad memory bound (1.15 x resident + 1 GiB): {checks}.\n"


def _merged(out: Path, results: list[dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    """`results` plus the other models' results already in `out` when they were measured with the same
    settings (one model can be re-measured without re-running the others), in FULL_MODELS order."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return results
    # read_mib only sizes the read-bandwidth measurement: rows from before it keep their copy ratio, marked so
    same = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(settings))).items() if k != "read_mib"}
    if {k: v for k, v in old.get("settings", {}).items() if k != "read_mib"} != same:
        return results
    new = {r["model"] for r in results}
    kept = [dict(r, date=r.get("date", old.get("machine", {}).get("date")))
            for r in old.get("results", []) if r.get("model") not in new]
    order = {m: i for i, m in enumerate(FULL_MODELS)}
    return sorted(kept + results, key=lambda r: order.get(r["model"].removesuffix("-tiny"), len(order)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=None, help=f"default: {' '.join(FULL_MODELS)}")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="the -tiny variants, short prompt (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per model")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        raw = json.loads(args.settings)
        settings = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        args.child_out.write_text(json.dumps(measure(args.child, settings)))
        return 0

    from benchmarks import make_real_size

    settings = QUICK if args.quick else Settings()
    names = args.models or [m + ("-tiny" if args.quick else "") for m in FULL_MODELS]
    unknown = [m for m in names if m not in make_real_size.MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {sorted(make_real_size.MODELS)}")
    cache = args.cache_dir or make_real_size.default_cache_dir()
    results = []
    for name in names:
        model_dir = cache / name
        if not (model_dir / "config.json").is_file():
            if not name.endswith("-tiny"):
                parser.error(f"{model_dir}: no checkpoint; run `python benchmarks/make_real_size.py {name}` first")
            make_real_size.make_model(name, cache, progress=False)
        if settings.serve_clients and not (model_dir / "tokenizer.json").is_file():
            parser.error(f"{model_dir}: no tokenizer.json (written since); run `python benchmarks/make_real_size.py "
                         f"{name}` again (complete shards are kept)")
        print(f"measuring {name} ...", flush=True)
        results.append(_child(model_dir, settings, args.timeout))
        print(json.dumps(results[-1]), flush=True)
        if settings.serve_clients:  # after the child has exited: the server holds the only copy of the model
            results[-1]["serve"] = measure_serving(model_dir, settings)
            print(json.dumps(results[-1]["serve"]), flush=True)
    info = machine_info()
    for r in results:
        r["date"] = info["date"]
    results = _merged(args.out, results, settings)
    write_json(args.out, {"machine": info, "settings": dataclasses.asdict(settings), "results": results})
    write_text(args.out.with_suffix(".md"), markdown(results, info))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
