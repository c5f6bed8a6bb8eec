"""GPU check and benchmark of the Pallas kernels (pallas_kernels) against their XLA references.

    python benchmarks/gpu_kernels.py [--out benchmarks/results/gpu_kernels.json] [--quick] [--seed N]
    python benchmarks/gpu_kernels.py --dry-run     # CPU: tiny shapes, kernels in Pallas interpret mode

One command, well under 8 minutes on one H200 (its checks and timings ran inside benchmarks/gpu_check.py there:
most of the time is compiling ~50 kernels and references); inputs total about 1.5 GB.
1. Ceilings measured on this device: a large dense bf16 matmul (TFLOP/s) and a large elementwise copy
   (GB/s, bytes read + written).
2. Checks: every kernel (gating, slot positions, encode, decode, their VJPs, permute/unpermute, gmm and its
   VJP, tgmm, FP8-block / MXFP4 / NVFP4 dense and grouped matmul) against its reference on fresh random inputs
   (normal draws, never zeros; a new seed each run unless --seed), with the tolerances of the CPU tests.
3. Timings: kernel vs XLA reference, each the median over several repeats of a back-to-back loop of calls
   (one block_until_ready per loop, so launch latency is hidden as long as the host runs ahead). Reported:
   time, achieved TFLOP/s and GB/s, the fraction of the measured ceilings, and the targets:
     gmm (T=16384, K=4096, N=1536, 64 balanced experts, bf16) >= 60% of the dense bf16 matmul rate
       (measured at the same T, K, N);
     quantized decode matmul (M <= 64) >= 60% of the copy bandwidth on the quantized bytes;
     encode / decode / permute >= 50% of the copy bandwidth.
Results go to a JSON file. The exit status is 1 when a check fails (a missed target is reported, not fatal).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `pallas_kernels` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.common import machine_info, repo_root, write_json

F32, BF16 = jnp.float32, jnp.bfloat16
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
QUANTIZERS = {name: fmt.quantize for name, fmt in pk.quant.FORMATS.items()}  # every weight format


# ------------------------------------------------------------------------------------------------- timing


def time_fn(fn: Callable, *args, min_loop_s: float = 0.05, repeats: int = 5, max_calls: int = 2000
            ) -> dict[str, float]:
    """Median seconds per call of `fn(*args)` over `repeats` loops of back-to-back calls (compiled first)."""
    jax.block_until_ready(fn(*args))
    calls = 1
    while True:  # grow the loop until it lasts min_loop_s
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        if elapsed >= min_loop_s or calls >= max_calls:
            break
        calls = min(max_calls, calls * max(2, int(min_loop_s / max(elapsed, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "calls_per_loop": calls,
            "repeats": repeats}


def make_timer(dry_run: bool) -> Callable[..., dict[str, float]]:
    """`time_fn`, or in a dry run a single call (the CPU interpreter only proves the timing code runs)."""
    return partial(time_fn, min_loop_s=0.0, repeats=1, max_calls=1) if dry_run else time_fn


def kernel_implementation(dry_run: bool) -> str:
    """The `implementation=` of the kernels under test: the Triton kernels on a GPU, else Pallas' interpreter."""
    return "pallas" if pk.gpu_backend() and not dry_run else "interpret"


def fresh_seed() -> int:
    """A new input seed for every run (recorded in the results, so a failure can be replayed with --seed)."""
    return secrets.randbelow(2 ** 31)


# ------------------------------------------------------------------------------------------------ inputs


class Inputs:
    """Fresh random device arrays (normal draws: never zeros)."""

    def __init__(self, seed: int):
        self.key = jax.random.key(seed)

    def normal(self, shape, dtype=F32, scale: float = 1.0) -> jax.Array:
        self.key, sub = jax.random.split(self.key)
        return (jax.random.normal(sub, shape, F32) * scale).astype(dtype)


def balanced_sizes(rows: int, groups: int) -> jax.Array:
    base = np.full(groups, rows // groups)
    base[: rows % groups] += 1
    return jnp.asarray(base, jnp.int32)


def skewed_sizes(rows: int, groups: int, seed: int, empty: int = 2) -> jax.Array:
    """Zipf-like sizes with a few empty groups, summing to rows."""
    weights = 1.0 / np.arange(1, groups + 1) ** 1.1
    np.random.RandomState(seed).shuffle(weights)
    weights[:empty] = 0
    sizes = np.floor(weights / weights.sum() * rows).astype(int)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


def buffer_routing(inputs: Inputs, tokens: int, experts: int, k: int, capacity: int):
    """(slots [k, S] into [E*C], weights [k, S]) from the reference gating on random logits."""
    routing = jax.jit(partial(pk.gating_reference, top_k=k))(inputs.normal((tokens, experts), scale=2.0))
    slots = jnp.where(routing.locations < capacity, routing.expert_ids * capacity + routing.locations,
                      experts * capacity).astype(jnp.int32)
    return slots, routing


# ------------------------------------------------------------------------------------------------- shapes


def shapes(dry_run: bool, quick: bool) -> dict[str, Any]:
    if dry_run:  # tiny: Pallas' interpreter on CPU
        return dict(matmul=128, copy_mib=1, gmm=(64, 64, 32, 4), quant=(4, 128, 32), quant_gmm=(24, 4, 32, 128),
                    dispatch=(32, 32, 4, 2), permute=(24, 32, 4, 3), gating=[(32, 8, 2, "softmax", 1)], dry=True)
    return dict(matmul=8192, copy_mib=1024, gmm=(16384, 4096, 1536, 64), quant=(64, 7168, 4096),
                quant_gmm=(512, 64, 1536, 4096), dispatch=(16384, 4096, 64, 2), permute=(4096, 4096, 64, 8),
                gating=[(16384, 64, 2, "softmax", 1), (16384, 256, 8, "sigmoid", 8)], dry=False,
                decode_rows=(16,) if quick else (1, 16, 64))


# ------------------------------------------------------------------------------------------------- checks


def max_error(actual, expected, scale_floor: float = 1.0) -> tuple[float, float]:
    """(max |actual - expected|, max(scale_floor, max |expected|)); inf error for a shape or NaN/inf mismatch."""
    a = np.asarray(jnp.asarray(actual, F32))
    e = np.asarray(jnp.asarray(expected, F32))
    scale = max(scale_floor, float(np.max(np.abs(e), initial=0.0)))
    if a.shape != e.shape or not np.array_equal(np.isfinite(a), np.isfinite(e)):
        return float("inf"), scale
    return float(np.max(np.abs(a - e), initial=0.0)), scale


def compare_trees(actual: Any, expected: Any, tolerance: float, *, scale_floor: float = 1.0) -> dict[str, Any]:
    """Leaf by leaf, |actual - expected| <= tolerance x max(scale_floor, max |expected leaf|); integer leaves
    (expert ids, slots, counts) must match exactly. A differing structure, shape or NaN/inf pattern fails.

    Returns {"ok", "max_abs_error", "max_relative_error" (error / scale, the number compared with the
    tolerance), "tolerance"}."""
    leaves_a, leaves_e = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
    errs = [max_error(a, e, scale_floor) for a, e in zip(leaves_a, leaves_e)]
    tols = [0.0 if jnp.issubdtype(jnp.asarray(e).dtype, jnp.integer) else tolerance for e in leaves_e]
    ok = len(leaves_a) == len(leaves_e) and all(err <= t * scale for (err, scale), t in zip(errs, tols))
    return {"ok": bool(ok), "max_abs_error": max((e for e, _ in errs), default=0.0),
            "max_relative_error": max((e / s for e, s in errs), default=0.0), "tolerance": tolerance}


def check_against_reference(name: str, kernel_fn: Callable, reference_fn: Callable, args: tuple,
                            dtype: str = "float32", exact: bool = False) -> dict[str, Any]:
    """One check: jitted kernel_fn(*args) == reference_fn(*args) within TOLERANCE[dtype] (0 if exact); an
    exception (a kernel that fails to compile or run) is a failed check, not a crash."""
    started = time.perf_counter()
    try:
        # float32 without TF32 on both sides: the kernels' float32 dots follow jax's default matmul precision
        # as XLA's do (TF32 by default on GPUs, IEEE float32 under "highest")
        with jax.default_matmul_precision("highest"):
            expected = jax.jit(reference_fn)(*args)
            actual = jax.jit(kernel_fn)(*args)
        cmp = compare_trees(actual, expected, 0.0 if exact else TOLERANCE[dtype])
        entry = {"name": name, "ok": cmp["ok"], "max_abs_error": cmp["max_abs_error"],
                 "max_relative_error": cmp["max_relative_error"], "tolerance": cmp["tolerance"], "dtype": dtype}
    except Exception as exc:
        entry = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    entry["seconds"] = round(time.perf_counter() - started, 3)
    print(f"  check {name:<34} {'ok' if entry['ok'] else 'FAIL'} "
          f"{entry.get('max_abs_error', entry.get('error', ''))}", flush=True)
    return entry


def _mosaic_gpu_unavailable(dry_run: bool) -> str | None:
    """Why the Mosaic GPU grouped-matmul checks cannot run here, or None (a real sm_90 / sm_100 GPU, tokamax)."""
    if dry_run or jax.default_backend() != "gpu":
        return "Mosaic GPU kernels run only on a GPU"
    from pallas_kernels.gmm import _pallas_mosaic_gpu as pallas_mosaic_gpu
    return pallas_mosaic_gpu.mosaic_gpu_unavailable()


def run_checks(impl: str, inputs: Inputs, dry_run: bool) -> list[dict[str, Any]]:
    """Kernel == reference on fresh inputs, per op (forward and custom-VJP gradients)."""
    results = []
    m = 1 if dry_run else 4  # size multiplier: small on CPU, a few thousand rows on the GPU

    def check(*args, **kwargs):
        results.append(check_against_reference(*args, **kwargs))

    kernel = dict(implementation=impl)
    small = dict(config=pk.GmmConfig(16, 32, 32, num_warps=4, num_stages=1)) if dry_run else {}

    # gating: ids / locations / counts exact, weights to float32 tolerance
    for score_fn, experts, k, groups in (("softmax", 16, 2, 1), ("sigmoid", 64, 8, 8)):
        if dry_run and score_fn == "sigmoid":
            continue
        logits = inputs.normal((100 * m + 3, experts), scale=2.0)
        bias = inputs.normal((experts,), scale=0.3)
        opts = dict(top_k=k, score_fn=score_fn, n_group=groups, topk_group=max(1, groups // 2))
        run = lambda impl_: (lambda l, b: pk.gating(l, correction_bias=b if score_fn == "sigmoid" else None,
                                                    implementation=impl_, **opts))
        check(f"gating_{score_fn}", run(impl), run("xla"), (logits, bias))  # ids/locations/counts exact

    # dispatch
    tokens, dim, experts, k = 96 * m + 5, 64 * m + 8, 8, 2
    capacity = tokens * k // experts  # some drops
    slots, routing = buffer_routing(inputs, tokens, experts, k, capacity)
    dtypes = (BF16,) if dry_run else (F32, BF16)  # the dry run only proves the script runs: fewer variants
    for dtype in dtypes:
        x = inputs.normal((tokens, dim), dtype)
        w = routing.weights.astype(dtype)
        data = inputs.normal((experts * capacity, dim), dtype)
        name = jnp.dtype(dtype).name
        check(f"encode_{name}", lambda x, w: pk.encode(x, w, slots, experts * capacity, **kernel),
              lambda x, w: pk.encode_reference(x, w, slots, experts * capacity), (x, w), name, exact=True)
        check(f"decode_{name}", lambda d, w: pk.decode(d, w, slots, **kernel),
              lambda d, w: pk.decode_reference(d, w, slots), (data, w), name)
    x = inputs.normal((tokens, dim))
    cot = inputs.normal((experts * capacity, dim))
    enc_grad = lambda impl_: jax.grad(lambda x, w: jnp.sum(pk.encode(x, w, slots, experts * capacity,
                                                                     implementation=impl_) * cot), (0, 1))
    check("encode_vjp", enc_grad(impl), enc_grad("xla"), (x, routing.weights))
    data = inputs.normal((experts * capacity, dim))
    cot2 = inputs.normal((tokens, dim))
    dec_grad = lambda impl_: jax.grad(lambda d, w: jnp.sum(pk.decode(d, w, slots, implementation=impl_) * cot2),
                                      (0, 1))
    check("decode_vjp", dec_grad(impl), dec_grad("xla"), (data, routing.weights))
    rows = pk.grouped_rows(routing.expert_ids, routing.locations, routing.counts)
    ones = jnp.ones_like(routing.weights)
    check("permute", lambda x: pk.permute(x, ones, rows, **kernel), lambda x: pk.encode_reference(x, ones, rows, ones.size),
          (x,), exact=True)

    # grouped matmul
    rows_, kdim, ndim, groups = 200 * m + 7, 96 * m + 32, 80 * m + 16, 6
    sizes = skewed_sizes(rows_ - 5, groups, 0, empty=1)  # an empty group, 5 rows past the sum
    for dtype in dtypes:
        lhs, rhs = inputs.normal((rows_, kdim), dtype), inputs.normal((groups, kdim, ndim), dtype)
        name = jnp.dtype(dtype).name
        check(f"gmm_{name}", lambda a, b: pk.gmm(a, b, sizes, **kernel, **small),
              lambda a, b: pk.gmm_reference(a, b, sizes, preferred_element_type=F32).astype(dtype), (lhs, rhs), name)
        grad = inputs.normal((rows_, ndim), dtype)
        check(f"tgmm_{name}", lambda a, g: pk.tgmm(a, g, sizes, **kernel, **small),
              lambda a, g: pk.tgmm_reference(a, g, sizes, preferred_element_type=F32).astype(dtype), (lhs, grad), name)
    lhs, rhs, cot = inputs.normal((rows_, kdim)), inputs.normal((groups, kdim, ndim)), inputs.normal((rows_, ndim))
    gmm_grad = lambda impl_: jax.grad(lambda a, b: jnp.sum(pk.gmm(a, b, sizes, implementation=impl_,
                                                                 **({} if impl_ == "xla" else small)) * cot), (0, 1))
    check("gmm_vjp", gmm_grad(impl), gmm_grad("xla"), (lhs, rhs))

    # the Mosaic GPU grouped matmul (tokamax; sm_90 / sm_100), only on such a GPU with tokamax installed: it has
    # no interpreter. K and N multiples of 64 (its limit); 807 rows, an empty group and 5 rows past the sum
    # exercise the row padding and masking around the kernel. bf16 operands; the float32 check is their float32
    # output (sm_90 only), held to the float32 tolerance: both sides accumulate the same exact products
    mosaic_reason = _mosaic_gpu_unavailable(dry_run)
    if mosaic_reason is None:
        from pallas_kernels.gmm import _pallas_mosaic_gpu as mosaic_gpu_gmm
        kdim_m, ndim_m = 256 * m, 192 * m
        lhs, rhs = inputs.normal((rows_, kdim_m), BF16), inputs.normal((groups, kdim_m, ndim_m), BF16)
        for out in (BF16, F32):
            name = jnp.dtype(out).name
            if not mosaic_gpu_gmm.supports(BF16, BF16, out, kdim_m, ndim_m):
                print(f"  check gmm_mosaic_gpu_{name}: not run (no {name} output on {pk.current_target().name})")
                continue
            check(f"gmm_mosaic_gpu_{name}",
                  lambda a, b, out=out: pk.gmm(a, b, sizes, preferred_element_type=out, implementation="mosaic_gpu"),
                  lambda a, b, out=out: pk.gmm_reference(a, b, sizes, preferred_element_type=F32).astype(out),
                  (lhs, rhs), name)
        cot_m = inputs.normal((rows_, ndim_m))
        mosaic_grad = lambda impl_: jax.grad(lambda a, b: jnp.sum(
            pk.gmm(a, b, sizes, implementation=impl_).astype(F32) * cot_m), (0, 1))
        check("gmm_mosaic_gpu_vjp_bfloat16", mosaic_grad("mosaic_gpu"), mosaic_grad("xla"), (lhs, rhs), "bfloat16")
    else:
        print(f"  check gmm_mosaic_gpu_*: not run ({mosaic_reason})")

    # quantized
    kq, nq = 128 * m + 128, 64 * m + 24
    for fmt, quantize in QUANTIZERS.items():
        w = jax.jit(quantize)(inputs.normal((nq, kq)))
        for rows_q, dtype in ((5, BF16),) + (() if dry_run else ((37 * m, F32),)):
            xq = inputs.normal((rows_q, kq), dtype)
            name = jnp.dtype(dtype).name
            check(f"quant_matmul_{fmt}_{name}_m{rows_q}", lambda x, w: pk.quant_matmul(x, w, **kernel),
                  lambda x, w: pk.quant_matmul_reference(x, w, out_dtype=F32).astype(dtype), (xq, w), name)
        if dry_run and fmt != "mxfp4":
            continue
        wg = jax.jit(quantize)(inputs.normal((4, nq, kq)))
        gsizes = jnp.asarray([9 * m, 0, 11 * m, 3], jnp.int32)
        xg = inputs.normal((int(gsizes.sum()) + 2, kq), BF16)
        check(f"quant_gmm_{fmt}", lambda x, w: pk.quant_gmm(x, w, gsizes, **kernel),
              lambda x, w: pk.quant_gmm_reference(x, w, gsizes, out_dtype=F32).astype(BF16), (xg, wg), "bfloat16")
    return results


# ------------------------------------------------------------------------------------------------ timings


def measure_ceilings(sz: dict, inputs: Inputs, timer) -> dict[str, Any]:
    n = sz["matmul"]
    a, b = inputs.normal((n, n), BF16), inputs.normal((n, n), BF16)
    t = timer(jax.jit(lambda a, b: a @ b), a, b)
    matmul_tflops = 2 * n ** 3 / t["median_s"] / 1e12
    elems = sz["copy_mib"] * 2 ** 20 // 2
    x = inputs.normal((elems,), BF16)
    t2 = timer(jax.jit(lambda x: x * 2), x)  # read + write: a copy that XLA cannot elide
    copy_gbps = 2 * elems * 2 / t2["median_s"] / 1e9
    print(f"ceilings: dense bf16 matmul {matmul_tflops:.1f} TFLOP/s ({n}^3), copy {copy_gbps:.0f} GB/s", flush=True)
    return {"matmul_bf16_tflops": matmul_tflops, "matmul_n": n, "copy_gbps": copy_gbps,
            "copy_bytes": 2 * elems * 2}


def bench_entry(name: str, kernel_fn: Callable, reference_fn: Callable, args: tuple, *, timer: Callable,
                ceilings: dict, flops: float = 0.0, nbytes: float = 0.0, target: tuple | None = None
                ) -> dict[str, Any]:
    """Times kernel_fn and reference_fn on args; rates, fractions of the ceilings and the target (kind, ratio,
    baseline) met or not. A variant that fails is recorded with its error."""
    entry: dict[str, Any] = {"name": name, "flops": flops, "bytes": nbytes}
    for label, fn in (("kernel", kernel_fn), ("reference", reference_fn)):
        try:
            entry[label] = timer(jax.jit(fn), *args)
        except Exception as exc:
            entry[label] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    k_s = entry["kernel"].get("median_s")
    r_s = entry["reference"].get("median_s")
    if k_s:
        entry["tflops"] = flops / k_s / 1e12 if flops else None
        entry["gbps"] = nbytes / k_s / 1e9 if nbytes else None
        entry["fraction_of_matmul"] = entry["tflops"] / ceilings["matmul_bf16_tflops"] if flops else None
        entry["fraction_of_copy"] = entry["gbps"] / ceilings["copy_gbps"] if nbytes else None
    if k_s and r_s:
        entry["speedup_vs_reference"] = r_s / k_s
    if target is not None and k_s:
        kind, ratio, base = target
        achieved = entry["tflops"] if kind == "tflops" else entry["gbps"]
        entry["target"] = {"metric": kind, "ratio": ratio, "baseline": base, "achieved_ratio": achieved / base,
                           "met": bool(achieved >= ratio * base)}
    tf = f"{entry['tflops']:.1f} TFLOP/s" if entry.get("tflops") else ""
    gb = f"{entry['gbps']:.0f} GB/s" if entry.get("gbps") else ""
    tgt = ""
    if "target" in entry:
        tgt = f" target {entry['target']['ratio']:.0%}: {entry['target']['achieved_ratio']:.0%} " \
              f"{'met' if entry['target']['met'] else 'MISSED'}"
    print(f"  {name:<40} kernel {k_s * 1e3 if k_s else float('nan'):9.3f} ms  "
          f"ref {r_s * 1e3 if r_s else float('nan'):9.3f} ms  {tf} {gb}{tgt}", flush=True)
    return entry


class Bench:
    """What the timing sections record into: `bench(name, kernel_fn, reference_fn, args, ...)` appends a
    `bench_entry`; `timer` and `results` are there for entries of another shape. (A plain class: the tests load
    this file without registering it as a module, which a dataclass needs.)"""

    def __init__(self, timer: Callable, ceilings: dict):
        self.timer, self.ceilings = timer, ceilings
        self.results: list[dict[str, Any]] = []

    def __call__(self, *args, **kwargs) -> None:
        self.results.append(bench_entry(*args, timer=self.timer, ceilings=self.ceilings, **kwargs))


def time_gmm(impl: str, sz: dict, inputs: Inputs, ceilings: dict, bench: Bench, seed: int) -> None:
    """Grouped matmul at the target shape; the baseline is the dense matmul of the same T, K, N."""
    kernel = dict(implementation=impl)
    t, kdim, ndim, g = sz["gmm"]
    lhs, rhs = inputs.normal((t, kdim), BF16), inputs.normal((g, kdim, ndim), BF16)
    dense = bench.timer(jax.jit(lambda a, b: a @ b), lhs, rhs[0])
    dense_tflops = 2 * t * kdim * ndim / dense["median_s"] / 1e12
    bench.results.append({"name": "dense_matmul_same_shape", "kernel": dense, "tflops": dense_tflops})
    print(f"  {'dense bf16 matmul, same T,K,N':<40} {dense['median_s'] * 1e3:9.3f} ms  {dense_tflops:.1f} TFLOP/s")
    flops = 2.0 * t * kdim * ndim
    variants = (("balanced", balanced_sizes(t, g)),) + (() if sz["dry"] else (("skewed", skewed_sizes(t, g, seed)),))
    for label, sizes in variants:
        bench(f"gmm_{label}_T{t}_K{kdim}_N{ndim}_G{g}", lambda a, b, s: pk.gmm(a, b, s, **kernel),
              lambda a, b, s: pk.gmm_reference(a, b, s), (lhs, rhs, sizes), flops=flops,
              target=("tflops", 0.6, dense_tflops) if label == "balanced" else None)
    sizes = balanced_sizes(t, g)
    cot = inputs.normal((t, ndim), BF16)
    vjp = lambda impl_: (lambda a, b: jax.grad(lambda a, b: jnp.sum((pk.gmm(a, b, sizes, implementation=impl_)
                                                                     * cot).astype(F32)), (0, 1))(a, b))
    bench("gmm_fwd_bwd_balanced", vjp(impl), vjp("xla"), (lhs, rhs), flops=3 * flops)
    bench("tgmm_balanced", lambda a, c: pk.tgmm(a, c, sizes, **kernel), lambda a, c: pk.tgmm_reference(a, c, sizes),
          (lhs, cot), flops=flops)


def time_quant(impl: str, sz: dict, inputs: Inputs, ceilings: dict, bench: Bench, seed: int) -> None:
    """Quantized decode matmul (memory bound on the quantized bytes: target 60% of the copy rate) and the
    grouped quantized matmul."""
    kernel = dict(implementation=impl)
    rows_max, kq, nq = sz["quant"]
    for fmt, quantize in QUANTIZERS.items():
        if sz["dry"] and fmt != "nvfp4":  # the dry run proves the timing code runs: one format (checks: all)
            continue
        w = jax.jit(quantize)(inputs.normal((nq, kq)))
        for rows in sz.get("decode_rows", (rows_max,)):
            x = inputs.normal((rows, kq), BF16)
            nbytes = w.nbytes() + x.size * 2 + rows * nq * 2
            bench(f"quant_matmul_{fmt}_M{rows}_K{kq}_N{nq}", lambda x, w: pk.quant_matmul(x, w, **kernel),
                  lambda x, w: pk.quant_matmul_reference(x, w), (x, w), flops=2.0 * rows * kq * nq, nbytes=nbytes,
                  target=("gbps", 0.6, ceilings["copy_gbps"]))
    tq, gq, nqg, kqg = sz["quant_gmm"]
    gsizes = balanced_sizes(tq, gq)
    for fmt, quantize in QUANTIZERS.items():
        if sz["dry"] and fmt != "nvfp4":
            continue
        wg = jax.jit(quantize)(inputs.normal((gq, nqg, kqg), scale=0.1))
        x = inputs.normal((tq, kqg), BF16)
        nbytes = wg.nbytes() + x.size * 2 + tq * nqg * 2
        bench(f"quant_gmm_{fmt}_T{tq}_G{gq}_N{nqg}_K{kqg}", lambda x, w: pk.quant_gmm(x, w, gsizes, **kernel),
              lambda x, w: pk.quant_gmm_reference(x, w, gsizes), (x, wg), flops=2.0 * tq * kqg * nqg, nbytes=nbytes)


def time_dispatch(impl: str, sz: dict, inputs: Inputs, ceilings: dict, bench: Bench, seed: int) -> None:
    """encode / decode / permute: bandwidth, target 50% of the copy rate."""
    kernel = dict(implementation=impl)
    copy = ceilings["copy_gbps"]
    tokens, dim, experts, k = sz["dispatch"]
    capacity = tokens * k // experts
    slots, routing = buffer_routing(inputs, tokens, experts, k, capacity)
    x = inputs.normal((tokens, dim), BF16)
    w = routing.weights.astype(BF16)
    num_slots = experts * capacity
    kept = int(jnp.sum(slots < num_slots))
    bench(f"encode_S{tokens}_M{dim}_E{experts}_k{k}", lambda x, w: pk.encode(x, w, slots, num_slots, **kernel),
          lambda x, w: pk.encode_reference(x, w, slots, num_slots), (x, w),
          nbytes=(kept + num_slots) * dim * 2.0, target=("gbps", 0.5, copy))
    data = inputs.normal((num_slots, dim), BF16)
    bench(f"decode_S{tokens}_M{dim}_E{experts}_k{k}", lambda d, w: pk.decode(d, w, slots, **kernel),
          lambda d, w: pk.decode_reference(d, w, slots), (data, w),
          nbytes=(kept + tokens) * dim * 2.0, target=("gbps", 0.5, copy))
    tokens, dim, experts, k = sz["permute"]
    routing = jax.jit(partial(pk.gating_reference, top_k=k))(inputs.normal((tokens, experts), scale=2.0))
    rows = pk.grouped_rows(routing.expert_ids, routing.locations, routing.counts)
    x = inputs.normal((tokens, dim), BF16)
    ones = jnp.ones((k, tokens), BF16)
    bench(f"permute_S{tokens}_M{dim}_k{k}", lambda x: pk.permute(x, ones, rows, **kernel),
          lambda x: pk.encode_reference(x, ones, rows, k * tokens), (x,),
          nbytes=2.0 * k * tokens * dim * 2, target=("gbps", 0.5, copy))


def time_gating(impl: str, sz: dict, inputs: Inputs, ceilings: dict, bench: Bench, seed: int) -> None:
    """Gating: bytes of logits in and routing out."""
    for tokens, experts, k, score_fn, groups in sz["gating"]:
        logits = inputs.normal((tokens, experts), F32, scale=2.0)
        bias = inputs.normal((experts,), scale=0.3)
        opts = dict(top_k=k, score_fn=score_fn, n_group=groups, topk_group=max(1, groups // 2))
        fn = lambda impl_: (lambda l, b: pk.gating(l, correction_bias=b if score_fn == "sigmoid" else None,
                                                   implementation=impl_, **opts))
        bench(f"gating_{score_fn}_S{tokens}_E{experts}_k{k}", fn(impl), fn("xla"), (logits, bias),
              nbytes=tokens * experts * 8.0 + 12.0 * k * tokens)


#: timing sections, in run order
TIMING_SECTIONS: dict[str, Callable[..., None]] = {
    "gmm": time_gmm, "quant": time_quant, "dispatch": time_dispatch, "gating": time_gating}


def run_timings(impl: str, sz: dict, inputs: Inputs, ceilings: dict, timer: Callable, seed: int,
                sections: tuple[str, ...] = tuple(TIMING_SECTIONS)) -> list[dict[str, Any]]:
    """Kernel vs XLA reference timings of the chosen `sections` (keys of TIMING_SECTIONS)."""
    bench = Bench(timer, ceilings)
    for section in sections:
        TIMING_SECTIONS[section](impl, sz, inputs, ceilings, bench, seed)
    return bench.results


# -------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON output (default benchmarks/results/gpu_kernels[_dry_run].json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpret-mode kernels")
    parser.add_argument("--quick", action="store_true", help="fewer decode sizes")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh each run)")
    parser.add_argument("--skip-timings", action="store_true", help="checks only")
    args = parser.parse_args(argv)

    seed = fresh_seed() if args.seed is None else args.seed
    on_gpu = pk.gpu_backend()
    if not on_gpu and not args.dry_run:
        print("no GPU backend: run with --dry-run on CPU (interpret-mode kernels, tiny shapes)", file=sys.stderr)
        return 2
    impl = kernel_implementation(args.dry_run)
    sz = shapes(args.dry_run, args.quick)
    timer = make_timer(args.dry_run)
    inputs = Inputs(seed)
    started = time.perf_counter()
    print(f"pallas_kernels on {jax.devices()[0].device_kind} ({jax.default_backend()}), implementation={impl}, "
          f"seed={seed}", flush=True)

    print("checks:", flush=True)
    checks = run_checks(impl, inputs, args.dry_run)
    report: dict[str, Any] = {"machine": machine_info(), "implementation": impl, "seed": seed,
                              "dry_run": bool(args.dry_run), "checks": checks}
    if not args.skip_timings:
        print("timings:", flush=True)
        report["ceilings"] = measure_ceilings(sz, inputs, timer)
        report["timings"] = run_timings(impl, sz, inputs, report["ceilings"], timer, seed)
    report["seconds"] = round(time.perf_counter() - started, 1)
    failed = [c["name"] for c in checks if not c["ok"]]
    report["checks_failed"] = failed
    default = "gpu_kernels_dry_run.json" if args.dry_run else "gpu_kernels.json"
    out = write_json(args.out or repo_root() / "benchmarks" / "results" / default, report)
    missed = [t["name"] for t in report.get("timings", []) if t.get("target") and not t["target"]["met"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed; targets missed: {missed or 'none'}; "
          f"{report['seconds']} s; wrote {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
