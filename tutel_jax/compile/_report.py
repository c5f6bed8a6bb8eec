"""What a compiled program says about itself: memory (`memory_analysis`), cost (`cost_analysis`), the project's
kernels and the collectives in its HLO; and the table / JSON of `tutel-jax compile`.

All figures are per device (an SPMD program is one device's program).
"""

from __future__ import annotations

import collections
import re
from typing import Any

from jax._src import xla_bridge
from jax._src.lib import _jax

__all__ = ["PartAnalysis", "analyze", "kernel_calls", "collective_counts", "COLLECTIVES", "format_table",
           "gib"]

COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")
#: custom-call targets of the project's Pallas kernels: Triton (GPU), Mosaic (TPU), Mosaic GPU
_KERNEL_TARGETS = {"__gpu$xla.gpu.triton": "triton", "tpu_custom_call": "mosaic", "mosaic_gpu": "mosaic_gpu"}
#: the project's kernels are named tutel_* (`pallas_kernels`); other Pallas calls are XLA's own (e.g. ragged-dot)
PROJECT_PREFIX = "tutel_"
#: the wrappers JAX's transformations put around a scope's name in op_name metadata
_TRANSFORMS = re.compile(r"^(?:[A-Za-z_]\w*\()+|\)+$")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (sizes under 0.01 GiB with three significant digits)."""
    return f"{n / 2**30:.2f}" if n >= 2**30 / 100 or n == 0 else f"{n / 2**30:.3g}"


def kernel_calls(hlo: str) -> dict[str, int]:
    """{kernel name: calls} of the Pallas kernels in an HLO text: custom calls to Triton (GPU) or Mosaic (TPU),
    named by the op that made them (`.../tutel_gmm/pallas_call` -> 'tutel_gmm'; the innermost project scope
    around a library's kernel, `.../tutel_tpu_gmm/jit(gmm)/pallas_call` -> 'tutel_tpu_gmm'; the target's name
    when the metadata has none)."""
    out: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        m = _CUSTOM_CALL.search(line)
        if not m or m.group(1) not in _KERNEL_TARGETS:
            continue
        op = re.search(r'op_name="([^"]+)"', line)
        path = op.group(1).split("/") if op else []
        while path and path[-1].startswith("pallas_call"):
            path.pop()
        path = [_TRANSFORMS.sub("", p) for p in path]  # 'transpose(jvp(tutel_gmm))' -> 'tutel_gmm'
        ours = [p for p in path if p.startswith(PROJECT_PREFIX)]
        out[ours[-1] if ours else path[-1] if path else _KERNEL_TARGETS[m.group(1)]] += 1
    return dict(sorted(out.items()))


def collective_counts(hlo: str) -> dict[str, int]:
    """{kind: count} of the collectives in an HLO text (async pairs counted once, by their -start)."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for kind in COLLECTIVES:
        out[kind] = len(re.findall(rf"\s{kind}(?:-start)?\(", hlo))
    return out


def _cost(compiled: Any) -> tuple[dict, str]:
    """(cost dict, source): XLA's cost analysis of the compiled program; where the GPU compiler gives none, the
    HLO cost analysis of the same compiled (partitioned, per-device) module run by the host's XLA."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if cost:
        return dict(cost), "xla"
    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)), "hlo-cost-analysis"


class PartAnalysis(dict):
    """One compiled part: memory (bytes), cost, kernels, collectives, compile seconds (a JSON-ready dict)."""


def analyze(compiled: Any, arg_bytes: dict[str, int], compile_seconds: float) -> PartAnalysis:
    """The analysis of one compiled part; `arg_bytes`: per-device bytes of its arguments by tag."""
    mem = compiled.memory_analysis()
    cost, source = _cost(compiled)
    hlo = compiled.as_text()
    calls = kernel_calls(hlo)
    transient = (mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                 + arg_bytes.get("activations", 0))
    return PartAnalysis(
        xla_memory={"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
                    "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes},
        argument_bytes=arg_bytes, transient_bytes=int(transient),
        flops=float(cost.get("flops", 0.0)), bytes=float(cost.get("bytes accessed", 0.0)), cost_source=source,
        kernels={k: v for k, v in calls.items() if k.startswith(PROJECT_PREFIX)},
        xla_kernels={k: v for k, v in calls.items() if not k.startswith(PROJECT_PREFIX)}, collectives=collective_counts(hlo), compile_seconds=round(compile_seconds, 2))


def format_table(result: dict) -> str:
    """The human-readable report of a `driver.compile_model` result."""
    hbm = result["hbm_bytes_per_device"]
    lines = [f"target {result['target']}: {result['devices']} x {result['device_kind']} ({result['platform']}, "
             f"{result['hosts']} host(s)), HBM {gib(hbm)} GiB per device",
             f"mesh: {result['mesh']['description']}",
             f"model: {result['model']['model_type']}, {result['model']['parameters'] / 1e9:.2f} B parameters, "
             f"{result['model']['layers']} layers, dtype {result['model']['dtype']}",
             "",
             f"{'program':<8} {'weights':>9} {'kv_cache':>9} {'optim':>9} {'act+tmp':>9} {'total':>9} {'fits':>5} "
             f"{'floor ms':>9} {'bound':>7} {'tok/s':>10} {'compile s':>9}",
             "(GiB per device)"]
    for p in result["programs"]:
        b, r = p["bytes_per_device"], p["roofline"]
        lines.append(f"{p['program']:<8} {gib(b['weights']):>9} {gib(b['kv_cache']):>9} {gib(b['optimizer']):>9} "
                     f"{gib(b['activations_and_temps']):>9} {gib(b['total']):>9} {'yes' if p['fits'] else 'NO':>5} "
                     f"{r['step_seconds_floor'] * 1e3:>9.3f} {r['bound']:>7} {r['tokens_per_second_ceiling']:>10.1f} "
                     f"{p['compile_seconds']:>9.1f}")
    lines.append("")
    for p in result["programs"]:
        kern = ", ".join(f"{k} x{v}" for k, v in p["kernels"].items()) or "none of the project's"
        if p["xla_kernels"]:
            kern += " (XLA's own: " + ", ".join(f"{k} x{v}" for k, v in p["xla_kernels"].items()) + ")"
        coll = ", ".join(f"{k} x{v}" for k, v in p["collectives"].items() if v) or "none"
        lines.append(f"{p['program']}: kernels {kern}; collectives {coll}")
        for error in p.get("compile_errors", []):
            lines.append(f"{p['program']}: refused by the compiler: {error}")
    for p in result["programs"]:
        x = p["xla_cost"]
        if x["step_seconds"] is not None:
            lines.append(f"{p['program']}: XLA's own cost analysis (reference, not the floor): {x['flops']:.3g} flops, "
                         f"{x['bytes']:.3g} bytes, {x['step_seconds'] * 1e3:.3f} ms ({x['source']})")
    lines += ["", f"how the totals are derived: {result['derivation']}"]
    return "\n".join(lines)
