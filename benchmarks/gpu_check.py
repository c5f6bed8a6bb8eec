"""One-shot GPU check of tutel-jax: kernels, the MoE layer, quantized generation, expert parallelism, timings.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json] [--seed N] [--quick]
    python benchmarks/gpu_check.py --dry-run [--out PATH]   # CPU: tiny shapes, kernels in Pallas interpret mode

Run on an NVIDIA H200 (JAX 0.11.2): every check passed in 331 s; benchmarks/results/gpu_check.{json,md}. Other
GPUs (A100, MI300) have not run it.

Checks, on fresh random inputs (a new seed every run unless --seed; the seed is in the results). The kernel
side runs with the default kernel_backend (unset: the kernels of the platform the program is compiled for) on a
GPU and 'interpret' in --dry-run (the default is XLA on a CPU, which would compare XLA with itself) and TUTEL_JAX_KERNELS=auto (the dense quantized matmuls, which always ask for 'auto',
run their kernels on a GPU and XLA in the dry run; kernel.* interprets them); the reference side runs
kernel_backend=None with TUTEL_JAX_KERNELS=xla: pure XLA. A kernel side whose traced program holds no
pallas_call fails (it would compare XLA with XLA).
 1. kernel.*: every Pallas kernel against its reference (benchmarks/gpu_kernels.py `run_checks`: gating, slot
    positions, encode/decode and their VJPs, permute, gmm/tgmm and the gmm VJP, FP8-block / MXFP4 / NVFP4
    matmuls), with its tolerances: max |kernel - reference| <= tol x max(1, max |reference|), tol = 2e-5 in
    float32, 2e-2 in bfloat16, 0 for integer outputs and exact gathers.
 2. layer.*: the MoE layer with kernels against the plain XLA layer, float32: output, loss, and gradients
    w.r.t. every parameter and the input, for a capacity config (Tutel 'top' gate, k=2, capacity_factor=1,
    ffn experts) and a dropless one (DeepSeek-V3 router, k=2 of 8 (dry run) / 16 experts in 4 groups, SwiGLU
    experts plus a shared expert, capacity_factor=0, dropless_impl='ragged'). Per leaf,
    max |a - b| <= tol x max |b|: tol = 2e-5 in interpret mode; on a GPU 1e-4 (float32 sums in another order:
    split-K partials, atomics). Checks 1-4 run under `jax.default_matmul_precision("highest")`, on both sides:
    the kernels' float32 dots follow that setting as XLA's do (TF32, a 10-bit mantissa, by default on GPUs;
    IEEE float32 under "highest"), so the comparison sees the kernels' own error, not TF32's.
 3. generate.*: `from_pretrained` + greedy `generate` (a 2 x 4-token random prompt, 8 new tokens) on the
    quantized fixtures tests/fixtures/hf/{deepseek_v3_fp8, gpt_oss_mxfp4, qwen3_moe_nvfp4}: the tokens with
    kernels must equal the reference's exactly (dropless_impl='ragged' on both sides: what 'auto' picks on a
    GPU, and the path that runs the grouped kernels in the dry run). The largest logit difference and the
    smallest top-2 logit margin of the reference are recorded (a flip at a margin below the TF32 error would
    show there).
 4. ep.*: on a 1-device mesh, the expert-parallel layer (`parallel.moe_apply_parallel`) against the
    single-device layer, outputs and gradients (tol as in 2), capacity and dropless (padded all_to_all); the
    library's ragged dropless exchange (`parallel.ragged_dropless`) with the emulated collective (everywhere)
    and with `lax.ragged_all_to_all` (GPU); and `lax.ragged_all_to_all` itself against a NumPy expectation
    (exact). XLA:CPU cannot compile ragged_all_to_all: on a CPU those two are recorded as skipped with that
    reason, after checking that they lower to the real primitive. On a GPU the expert-parallel side runs with
    the kernels (kernel_backend='auto', inside shard_map); in --dry-run it runs the plain XLA layer, because
    Pallas' interpreter cannot evaluate a kernel inside shard_map(check_vma=True) (tests/kernels/test_pallas_lowering.py
    proves by lowering that the kernels go inside the expert-parallel layer).
 5. timings: the dense bf16 matmul and copy ceilings, gmm and the quantized decode matmuls against them
    (gpu_kernels `measure_ceilings` and the 'gmm' and 'quant' sections of `run_timings`); a missed target is
    reported, not a failure; a kernel that fails to run is a failure.
Output: a JSON file and a Markdown table next to it (same stem, .md): machine info, one row per check (status
pass / fail / skipped with its reason, error and tolerance, seconds), the timings. A check that raises is a
failure with its message; the others still run. Exit status 1 when any check fails, else 0 (2: no GPU and no
--dry-run).

--dry-run: the same checks on a CPU at tiny shapes, kernels in Pallas interpret mode, XLA:CPU compiling without
LLVM optimisation (DRY_RUN_XLA_FLAGS; compiling is most of the time there); its reports go to a temp folder
unless --out is given, never to benchmarks/results.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import zlib
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

if __package__ in (None, ""):  # run as a script: make `tutel_jax`, `pallas_kernels` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels as pk
from benchmarks import gpu_kernels as gk
from benchmarks.check_records import (FAIL, PASS, SKIPPED, compare, count_primitive, error_text, exit_status,
                                      from_kernel_check, merge, pallas_calls, require_kernels, run_check, skipped,
                                      summarize)
from benchmarks.common import machine_info, markdown_table, repo_root, write_json, write_text
from tutel_jax import init_params, make_config, moe_apply

#: per-leaf relative tolerance of the layer / expert-parallel comparisons, by kernel implementation
LAYER_TOLERANCE = {"interpret": 2e-5, "pallas": 1e-4}
#: quantized HF fixtures of the generation checks (greedy tokens must match exactly)
QUANT_FIXTURES = ("deepseek_v3_fp8", "gpt_oss_mxfp4", "qwen3_moe_nvfp4")
RAGGED_CPU_REASON = "XLA:CPU cannot compile ragged_all_to_all"
HF_FIXTURES = repo_root() / "tests" / "fixtures" / "hf"
#: the dry run compiles without LLVM optimisation: compiling is most of its time at tiny shapes
DRY_RUN_XLA_FLAGS = "--xla_backend_optimization_level=0"


# ----------------------------------------------------------------------------------------------------- sizes


def layer_sizes(dry_run: bool) -> dict[str, int]:
    """Shapes of the layer and expert-parallel checks: tiny for the CPU interpreter."""
    if dry_run:
        return dict(batch=2, seq=8, model_dim=16, hidden=16, experts=8, ep_batch=2, ep_seq=8)
    return dict(batch=4, seq=512, model_dim=512, hidden=1024, experts=16, ep_batch=2, ep_seq=256)


@contextlib.contextmanager
def kernels_env(value: str) -> Iterator[None]:
    """Sets pallas_kernels' TUTEL_JAX_KERNELS (what an op's implementation='auto' resolves to, read when a
    program is traced) for the block, then restores it. 'xla' makes a reference pure XLA: with
    kernel_backend=None the dense quantized matmuls (attention, shared experts) and the quantized experts still
    ask for 'auto', which is the Pallas kernel on a GPU. 'auto' on the kernel side undoes a user's setting."""
    old = os.environ.get(pk.ENV_VAR)
    os.environ[pk.ENV_VAR] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(pk.ENV_VAR, None)
        else:
            os.environ[pk.ENV_VAR] = old


def key_for(seed: int, name: str) -> jax.Array:
    """A PRNG key of this run's seed and a check's name (stable across processes, unlike hash())."""
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


# ------------------------------------------------------------------------------------------- layer checks


def layer_kwargs(kind: str, sz: dict[str, int]) -> tuple[dict[str, Any], float]:
    """make_config arguments and the capacity factor of the 'capacity' or 'dropless' layer."""
    if kind == "capacity":
        return dict(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=sz["model_dim"],
                    experts={"type": "ffn", "count_per_node": sz["experts"],
                             "hidden_size_per_expert": sz["hidden"]}), 1.0
    if kind == "dropless":
        return dict(gate_type={"type": "deepseek_v3", "k": 2, "n_group": 4, "topk_group": 2,
                               "routed_scaling_factor": 2.5}, model_dim=sz["model_dim"],
                    experts={"type": "swiglu", "count_per_node": sz["experts"], "hidden_size_per_expert": sz["hidden"],
                             "shared": {"hidden_size": sz["hidden"]}}, dropless_impl="ragged"), 0.0
    raise ValueError(f"unknown layer kind {kind!r}")


def layer_params(config: Any, key: jax.Array) -> dict:
    """init_params, with a random DeepSeek selection bias (zeros would leave that path untested)."""
    params = init_params(config, key)
    gate = params["gates"][0]
    if "e_score_correction_bias" in gate:
        bias = 0.1 * jax.random.normal(jax.random.fold_in(key, 1), gate["e_score_correction_bias"].shape)
        params["gates"][0] = {**gate, "e_score_correction_bias": bias}
    return params


def loss_and_grads(apply: Callable, params: dict, x: jax.Array, up: jax.Array) -> dict[str, Any]:
    """{'y', 'loss', 'grad_params', 'grad_x', 'pallas_calls'} of loss = sum(y * up) + 0.1 * l_aux, jitted (the
    kernels counted in the traced program)."""
    def fn(p, x):
        y, aux = apply(p, x)
        return jnp.sum(y * up) + 0.1 * aux.l_aux, y
    traced = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)).trace(params, x)
    (loss, y), (gp, gx) = traced.lower().compile()(params, x)
    return {"y": y, "loss": loss, "grad_params": gp, "grad_x": gx,
            "pallas_calls": count_primitive(traced.jaxpr, "pallas_call")}


def compare_runs(actual: dict[str, Any], expected: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """merge() of the outputs, loss and gradients of two loss_and_grads results."""
    return merge({name: compare(actual[name], expected[name], tolerance) for name in ("y", "loss", "grad_params",
                                                                                       "grad_x")})


def check_layer(kind: str, backend: str, sz: dict[str, int], seed: int, tolerance: float) -> dict[str, Any]:
    """The layer with kernel_backend=backend against kernel_backend=None: output, loss and every gradient."""
    kwargs, cf = layer_kwargs(kind, sz)
    plain, kernels = make_config(**kwargs), make_config(**kwargs, kernel_backend=backend)
    key = key_for(seed, f"layer.{kind}")
    params = layer_params(plain, key)
    x = jax.random.normal(jax.random.fold_in(key, 2), (sz["batch"], sz["seq"], sz["model_dim"]))
    up = jax.random.normal(jax.random.fold_in(key, 3), x.shape)
    with kernels_env("xla"):
        expected = loss_and_grads(lambda p, x: moe_apply(p, x, plain, capacity_factor=cf), params, x, up)
    with kernels_env("auto"):
        actual = loss_and_grads(lambda p, x: moe_apply(p, x, kernels, capacity_factor=cf), params, x, up)
    record = {**compare_runs(actual, expected, tolerance), "kernel_backend": backend, "capacity_factor": cf,
              "shape": list(x.shape)}
    return require_kernels(record, actual["pallas_calls"])


# ------------------------------------------------------------------------------------------ generate checks


def check_generate(case: str, backend: str, seed: int, max_new_tokens: int = 8, prompt_shape=(2, 4)
                   ) -> dict[str, Any]:
    """Greedy tokens of from_pretrained(case, kernel_backend=backend) == those of kernel_backend=None with every
    op on XLA (TUTEL_JAX_KERNELS=xla)."""
    from tutel_jax.models import from_pretrained
    from tutel_jax.serving import generate

    path = HF_FIXTURES / case
    with kernels_env("xla"):
        model = from_pretrained(path, kernel_backend=None, dropless_impl="ragged")
        rng = np.random.default_rng(zlib.crc32(f"{seed}:{case}".encode()))
        prompt = rng.integers(0, model.spec.vocab_size, prompt_shape).astype(np.int32)
        ref = generate(model, prompt, max_new_tokens, return_logits=True)
    with kernels_env("auto"):
        model = from_pretrained(path, kernel_backend=backend, dropless_impl="ragged")
        got = generate(model, prompt, max_new_tokens, return_logits=True)
        calls = pallas_calls(lambda ids: model(ids), jnp.asarray(prompt))
    same = bool(np.array_equal(ref.tokens, got.tokens))
    top2 = np.sort(ref.logits, axis=-1)[..., -2:]
    record = {"status": PASS if same else FAIL, "tokens_equal": same, "kernel_backend": backend,
              "prompt": prompt.tolist(), "tokens_xla": ref.tokens.tolist(), "tokens_kernels": got.tokens.tolist(),
              "max_logit_abs_diff": float(np.max(np.abs(ref.logits - got.logits))),
              "min_top2_margin_xla": float(np.min(top2[..., 1] - top2[..., 0]))}
    record["detail"] = (f"tokens equal; max logit diff {record['max_logit_abs_diff']:.1e}" if same else
                        f"tokens differ; max logit diff {record['max_logit_abs_diff']:.1e}, min top-2 margin "
                        f"{record['min_top2_margin_xla']:.1e}")
    return require_kernels(record, calls)


# -------------------------------------------------------------------------------- expert-parallel checks


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("expert",))


_EP_CASES: dict[tuple, tuple] = {}


def ep_case(kind: str, sz: dict[str, int], seed: int) -> tuple:
    """(config, params, x, up, capacity_factor, single-device result) of the plain XLA layer for world_size 1;
    cached, so the dropless exchanges share one single-device reference."""
    cache_key = (kind, seed, tuple(sorted(sz.items())))
    if cache_key not in _EP_CASES:
        kwargs, cf = layer_kwargs(kind, sz)
        config = make_config(**kwargs, world_size=1)
        key = key_for(seed, f"ep.{kind}")
        params = layer_params(config, key)
        x = jax.random.normal(jax.random.fold_in(key, 2), (sz["ep_batch"], sz["ep_seq"], sz["model_dim"]))
        up = jax.random.normal(jax.random.fold_in(key, 3), x.shape)
        expected = loss_and_grads(lambda p, x: moe_apply(p, x, config, capacity_factor=cf), params, x, up)
        _EP_CASES[cache_key] = (config, params, x, up, cf, expected)
    return _EP_CASES[cache_key]


def check_expert_parallel(kind: str, sz: dict[str, int], seed: int, tolerance: float, backend: str | None,
                          dropless_exchange: str = "padded") -> dict[str, Any]:
    """moe_apply_parallel on a 1-device mesh (its kernels with `backend`) == moe_apply in plain XLA: output,
    loss and every gradient."""
    from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params

    config, params, x, up, cf, expected = ep_case(kind, sz, seed)
    if backend is not None:
        kwargs, _ = layer_kwargs(kind, sz)
        config = make_config(**kwargs, world_size=1, kernel_backend=backend)
    placement = ExpertParallel(one_device_mesh())
    parallel = lambda p, x: moe_apply_parallel(p, x, config, placement, capacity_factor=cf,
                                               dropless_exchange=dropless_exchange)
    actual = loss_and_grads(parallel, shard_params(params, placement, config), x, up)
    return {**compare_runs(actual, expected, tolerance), "kernel_backend": backend,
            "dropless_exchange": dropless_exchange}


def lowers_to_ragged_all_to_all(fn: Callable, *args) -> bool:
    """Whether jit(fn)(*args) lowers (StableHLO text) to the real ragged_all_to_all primitive."""
    return "ragged_all_to_all" in jax.jit(fn).lower(*args).as_text()


def check_ragged_exchange(sz: dict[str, int], seed: int, tolerance: float, backend: str | None) -> dict[str, Any]:
    """The library's ragged dropless exchange with lax.ragged_all_to_all (GPU/TPU) == the single-device layer;
    on a CPU: lowered (forward and backward), then skipped."""
    from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params
    from tutel_jax.parallel import ragged_supported

    if ragged_supported():
        return check_expert_parallel("dropless", sz, seed, tolerance, backend, dropless_exchange="ragged")
    config, params, x, up, cf, _ = ep_case("dropless", sz, seed)
    placement = ExpertParallel(one_device_mesh())

    def loss(p, x):
        y, aux = moe_apply_parallel(p, x, config, placement, capacity_factor=cf, dropless_exchange="ragged")
        return jnp.sum(y * up) + 0.1 * aux.l_aux

    if not lowers_to_ragged_all_to_all(jax.grad(loss, argnums=(0, 1)), shard_params(params, placement, config), x):
        return {"status": FAIL, "error": "dropless_exchange='ragged' did not lower to ragged_all_to_all"}
    return skipped(RAGGED_CPU_REASON, lowered=True)


def ragged_all_to_all_cases(seed: int, rows: int = 32, width: int = 8, out_rows: int = 40
                            ) -> list[tuple[np.ndarray, ...]]:
    """(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes) for one device: random slices,
    an empty one and a full one."""
    rng = np.random.default_rng(zlib.crc32(f"{seed}:ragged_all_to_all".encode()))
    cases = []
    for size in (int(rng.integers(1, rows)), 0, rows):
        start = int(rng.integers(0, rows - size + 1))
        dest = int(rng.integers(0, out_rows - size + 1))
        operand = rng.standard_normal((rows, width)).astype(np.float32)
        output = rng.standard_normal((out_rows, width)).astype(np.float32)  # kept where nothing arrives
        ints = lambda v: np.asarray([v], np.int32)
        cases.append((operand, output, ints(start), ints(size), ints(dest), ints(size)))
    return cases


def ragged_all_to_all_expected(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes) -> np.ndarray:
    """NumPy: on one device the slice operand[in : in + n] lands at output[out : out + n]; the rest is kept."""
    result = output.copy()
    start, size, dest = int(input_offsets[0]), int(send_sizes[0]), int(output_offsets[0])
    result[dest:dest + size] = operand[start:start + size]
    return result


def ragged_all_to_all_on_mesh(mesh: Mesh) -> Callable:
    """lax.ragged_all_to_all over the mesh's single axis, every argument split along it (so varying)."""
    from tutel_jax.parallel import shard_map

    axis = mesh.axis_names[0]
    fn = lambda *args: jax.lax.ragged_all_to_all(*args, axis_name=axis)
    return jax.jit(shard_map(fn, mesh, in_specs=(P(axis),) * 6, out_specs=P(axis)))


def check_ragged_all_to_all(seed: int) -> dict[str, Any]:
    """lax.ragged_all_to_all on a 1-device mesh == NumPy, exactly; on a CPU: lowered, then skipped."""
    from tutel_jax.parallel import ragged_supported

    fn = ragged_all_to_all_on_mesh(one_device_mesh())
    cases = ragged_all_to_all_cases(seed)
    if not ragged_supported():
        if not lowers_to_ragged_all_to_all(fn, *cases[0]):
            return {"status": FAIL, "error": "lax.ragged_all_to_all did not lower to ragged_all_to_all"}
        return skipped(RAGGED_CPU_REASON, lowered=True)
    parts = {f"case{i}_n{int(c[3][0])}": compare(fn(*c), ragged_all_to_all_expected(*c), 0.0, relative_to_leaf=False)
             for i, c in enumerate(cases)}
    return merge(parts)


# ----------------------------------------------------------------------------------------------- timings


def run_timings(impl: str, dry_run: bool, quick: bool, inputs: gk.Inputs, seed: int) -> dict[str, Any]:
    """gpu_kernels' ceilings and its 'gmm' and 'quant' timing sections; a failed check if a kernel did not run."""
    sz = gk.shapes(dry_run, quick)
    timer = gk.make_timer(dry_run)
    ceilings = gk.measure_ceilings(sz, inputs, timer)
    timings = gk.run_timings(impl, sz, inputs, ceilings, timer, seed, sections=("gmm", "quant"))
    errors = {t["name"]: t[label]["error"] for t in timings for label in ("kernel", "reference")
              if isinstance(t.get(label), dict) and "error" in t[label]}
    missed = [t["name"] for t in timings if t.get("target") and not t["target"]["met"]]
    record = {"status": FAIL if errors else PASS, "ceilings": ceilings, "timings": timings, "targets_missed": missed,
              "detail": f"{len(timings)} timed; targets missed: {len(missed)}"}
    if errors:
        record["error"] = "; ".join(f"{n}: {e}" for n, e in errors.items())[:3000]
    return record


# -------------------------------------------------------------------------------------------------- report


def markdown_report(report: dict[str, Any]) -> str:
    """Machine info, the checks (one row each) and the timings as Markdown."""
    m = report["machine"]
    lines = [f"# tutel-jax GPU check{' (dry run: CPU, interpret-mode kernels)' if report['dry_run'] else ''}", "",
             f"{m['device_kind']} ({m['backend']}, {m['device_count']} device(s)), JAX {m['jax_version']}, "
             f"{m['date']}; seed {report['seed']}; kernel_backend={report['kernel_backend']!r}, kernels "
             f"implementation={report['kernel_implementation']!r}; {report['seconds']} s.", "",
             report["note"], ""]
    rows = []
    for c in report["checks"]:
        status = c["status"] + (f": {c['reason']}" if c["status"] == SKIPPED else "")
        if "error" in c:
            status += ": " + c["error"].splitlines()[0][:120].replace("|", "/")
        err = f"{c['max_relative_error']:.2e}" if "max_relative_error" in c else (
            f"{c['max_abs_error']:.2e}" if "max_abs_error" in c else "")
        tol = f"{c['tolerance']:.0e}" if "tolerance" in c else ""
        rows.append([c["name"], status, err, tol, f"{c['seconds']:.1f}", c.get("detail", "")])
    lines += [markdown_table(["check", "status", "error / scale", "tolerance", "seconds", "detail"], rows,
                             "llrrrl"), ""]
    n = report["summary"]["counts"]
    lines += [f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIPPED]} skipped of {report['summary']['total']}.", ""]
    if report.get("ceilings"):
        c = report["ceilings"]
        lines += [f"Ceilings: dense bf16 matmul {c['matmul_bf16_tflops']:.2f} TFLOP/s ({c['matmul_n']}^3), "
                  f"copy {c['copy_gbps']:.1f} GB/s.", ""]
    trows = []
    for t in report.get("timings", []):
        ms = lambda v: f"{v['median_s'] * 1e3:.3f}" if isinstance(v, dict) and "median_s" in v else "error"
        frac = t.get("fraction_of_matmul") or t.get("fraction_of_copy")
        target = ""
        if "target" in t:
            target = f"{t['target']['ratio']:.0%} of {t['target']['metric']}: " \
                     f"{'met' if t['target']['met'] else 'missed'} ({t['target']['achieved_ratio']:.0%})"
        trows.append([t["name"], ms(t.get("kernel")), ms(t["reference"]) if "reference" in t else "",
                      f"{t['tflops']:.2f}" if t.get("tflops") else "", f"{t['gbps']:.1f}" if t.get("gbps") else "",
                      f"{frac:.0%}" if frac else "", target])
    if trows:
        lines += [markdown_table(["timing", "kernel ms", "XLA ms", "TFLOP/s", "GB/s", "of ceiling", "target"],
                                 trows, "lrrrrrl"), ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """The JSON file and the Markdown table next to it (same stem, .md)."""
    return write_json(out, report), write_text(out.with_suffix(".md"), markdown_report(report))


def default_output(dry_run: bool) -> Path:
    """benchmarks/results/gpu_check.json; a dry run never writes there (a temp folder instead)."""
    if dry_run:
        return Path(tempfile.gettempdir()) / "tutel_jax_gpu_check" / "gpu_check_dry_run.json"
    return repo_root() / "benchmarks" / "results" / "gpu_check.json"


# ---------------------------------------------------------------------------------------------------- main


def all_checks(backend: str, impl: str, dry_run: bool, quick: bool, seed: int) -> list[tuple[str, Callable]]:
    """(name, thunk) of every check, in run order."""
    sz = layer_sizes(dry_run)
    tol = LAYER_TOLERANCE[impl]
    checks: list[tuple[str, Callable]] = [
        (f"layer.{kind}", partial(check_layer, kind, backend, sz, seed, tol)) for kind in ("capacity", "dropless")]
    checks += [(f"generate.{case}", partial(check_generate, case, backend, seed)) for case in QUANT_FIXTURES]
    ep_backend = None if dry_run else backend  # the interpreter cannot run kernels inside shard_map
    checks += [(f"ep.{kind}", partial(check_expert_parallel, kind, sz, seed, tol, ep_backend))
               for kind in ("capacity", "dropless")]
    checks += [("ep.dropless_emulated_exchange", partial(check_expert_parallel, "dropless", sz, seed, tol,
                                                         ep_backend, dropless_exchange="emulated")),
               ("ep.dropless_ragged_exchange", partial(check_ragged_exchange, sz, seed, tol, ep_backend)),
               ("ep.ragged_all_to_all", partial(check_ragged_all_to_all, seed))]
    return checks


def use_fast_cpu_compile() -> None:
    """Adds DRY_RUN_XLA_FLAGS to XLA_FLAGS (about a third less CPU time for the dry run; no effect once JAX's
    backend has started, e.g. when main() is called after other JAX work in the same process)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DRY_RUN_XLA_FLAGS}".strip()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output, a .md next to it (default benchmarks/results/gpu_check.json; with "
                             "--dry-run a temp folder)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on a CPU: tiny shapes, interpret-mode kernels (proves the script runs, no GPU figure)")
    parser.add_argument("--quick", action="store_true", help="fewer decode sizes in the timings")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh each run)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        use_fast_cpu_compile()
    if not pk.gpu_backend() and not args.dry_run:
        print("no GPU backend: run with --dry-run on CPU (interpret-mode kernels, tiny shapes)", file=sys.stderr)
        return 2
    seed = gk.fresh_seed() if args.seed is None else args.seed
    impl = gk.kernel_implementation(args.dry_run)
    # the layer's kernel_backend: on a GPU the default (unset: the compile platform's kernels), so the checks
    # prove that a default program holds the kernels; in the dry run the interpreter, asked for explicitly
    backend = None if impl == "pallas" else "interpret"
    started = time.perf_counter()
    print(f"tutel-jax GPU check on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"kernel_backend={backend!r}, kernels={impl!r}, seed={seed}{', dry run' if args.dry_run else ''}",
          flush=True)

    print("kernels:", flush=True)
    try:
        checks = [from_kernel_check(e) for e in gk.run_checks(impl, gk.Inputs(seed), args.dry_run)]
    except Exception as exc:  # noqa: BLE001 - gpu_kernels records per-check failures; this is a crash of the set
        checks = [{"name": "kernel.run_checks", "status": FAIL, "error": error_text(exc), "seconds": 0.0}]
    print("layer, generation, expert parallelism:", flush=True)
    with jax.default_matmul_precision("highest"):  # float32 without TF32 on both sides (see the docstring)
        checks += [run_check(name, fn) for name, fn in all_checks(backend, impl, args.dry_run, args.quick, seed)]
    print("timings:", flush=True)
    timing = run_check("timings.gmm_and_quant_decode",
                       lambda: run_timings(impl, args.dry_run, args.quick, gk.Inputs(seed + 1), seed))
    ceilings, timings = timing.pop("ceilings", None), timing.pop("timings", [])
    checks.append(timing)

    report: dict[str, Any] = {
        "tool": "benchmarks/gpu_check.py", "dry_run": bool(args.dry_run), "seed": seed, "kernel_backend": backend,
        "kernel_implementation": impl, "layer_tolerance": LAYER_TOLERANCE[impl], "machine": machine_info(),
        "note": ("Dry run: CPU, Pallas interpret mode, tiny shapes; proves the script runs, says nothing about a GPU."
                 if args.dry_run else "GPU run."),
        "checks": checks, "summary": summarize(checks), "ceilings": ceilings, "timings": timings,
        "seconds": round(time.perf_counter() - started, 1)}
    json_path, md_path = write_report(report, args.out or default_output(args.dry_run))
    s, n = report["summary"], report["summary"]["counts"]
    print(f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIPPED]} skipped of {s['total']} checks in {report['seconds']} s"
          + (f"; FAILED: {', '.join(s['failed'])}" if s["failed"] else "")
          + "".join(f"\n  skipped {n}: {r}" for n, r in s["skipped"].items())
          + f"\nwrote {json_path} and {md_path}", flush=True)
    return exit_status(checks)


if __name__ == "__main__":
    sys.exit(main())
