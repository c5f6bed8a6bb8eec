"""`tutel-jax compile MODEL --target T [--batch B] [--seq S] [--mode serve|train] [--dtype D] [--json F]`

Does MODEL fit the target, and how fast can a step go? Compiled on this CPU host without the target's devices
(jax >= 0.12: `jax.experimental.topologies`), over abstract weights of exactly the loader's shapes and dtypes.

MODEL: an HF checkpoint directory (only its config.json is read) or a config.json file.
Targets: a100-40gb, a100-80gb, h100, h200, b200 with an optional xN device count (h100x8); TPU slices
v5e:AxB, v6e:AxB, v5p:AxBxC. Figures per device: `hardware.HARDWARE`.

JSON (--json F): target, platform, device_kind, devices, hosts, hbm_bytes_per_device, hardware, mesh, model,
batch, seq, mode, derivation, decode_rooflines, and programs: [{program ('prefill', 'decode' or 'train'),
bytes_per_device {weights, kv_cache, optimizer, activations_and_temps, total}, fits, devices_to_fit,
compile_errors (parts the compiler refused for lack of HBM), weights_from_programs, kernels {name: calls per
step}, collectives {all-to-all, all-reduce, all-gather, reduce-scatter, collective-permute: per step}, roofline
(analytic, `_roofline.py`: {step_seconds_floor, bound, flops, bytes, tokens, tokens_per_second_ceiling,
compute_seconds, memory_seconds, flops_terms, bytes_terms, routed_experts_read_per_layer, source}), xla_cost
(XLA's own cost analysis, reference only: {flops, bytes, step_seconds, source, note}), compile_seconds, parts:
[per compiled program]}].

Exit codes: 0 fits; 2 bad input, no deviceless support, or a program that does not fit (the table and JSON are
still written, then one line with the bytes needed, the HBM and the device count that would fit).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ..layer import execution
from ..models import check_quantization_config, checkpoint_layout, stored_float_dtype, spec_from_config
from ._driver import compile_model
from ._hardware import HARDWARE
from ._report import format_table, gib
from ._topology import DevicelessUnavailable, TargetError, check_deviceless, parse_target

__all__ = ["main"]

PROG = "tutel-jax compile"
DTYPES = ("bfloat16", "float16", "float32")


class _Bad(Exception):
    """Bad input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise _Bad(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


#: the shared execution flags compile applies: a loaded model's knobs but per_layer_jit (its programs are the
#: per-layer ones by design, the totals derived from them); the exchange knobs are expert-parallel training's
KNOBS = tuple(k for k in execution.MODEL_KNOBS if k != "per_layer_jit")


def _parser() -> _Parser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="HF checkpoint directory or config.json (no weights needed)")
    p.add_argument("--target", required=True,
                   help=f"{', '.join(h for h in HARDWARE if HARDWARE[h].platform == 'gpu')}[xN], "
                        "v5e:AxB, v6e:AxB, v5p:AxBxC")
    p.add_argument("--batch", type=_positive, default=1, help="rows per step (default 1)")
    p.add_argument("--seq", type=_positive, default=2048,
                   help="prompt tokens of the prefill, KV cache slots of the decode, tokens per row in training "
                        "(default 2048)")
    p.add_argument("--mode", choices=("serve", "train"), default="serve",
                   help="serve: prefill + one decode step (default); train: loss, gradients and an AdamW update")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the model's float dtype (default: the checkpoint's, config.json dtype / torch_dtype)")
    p.add_argument("--json", metavar="F", help="also write the report as JSON to F")
    execution.add_arguments(p)
    return p


def _read_config(model: str) -> dict:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise _Bad(f"MODEL: directory {model!r} has no config.json")
    elif not path.is_file():
        raise _Bad(f"MODEL: no such file or directory {model!r} (expected a checkpoint directory or a config.json)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Bad(f"MODEL: {path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _Bad(f"MODEL: {path} must hold a JSON object, got {type(config).__name__}")
    return config


def _check_config(config: dict) -> None:
    """The loader's checks, without weights: spec, layout, quantization format (one line naming the key)."""
    try:
        spec_from_config(config)
        check_quantization_config(config)
        checkpoint_layout(config)
    except KeyError as e:
        raise _Bad(f"config.json: missing key {e.args[0]!r} (the {config.get('model_type')} family needs it)") from None
    except (ValueError, TypeError) as e:
        raise _Bad(f"config.json: {e}") from None


def _dtype(config: dict, name: str | None) -> str:
    if name is not None:
        return name
    try:
        stored = stored_float_dtype(config)
    except ValueError:
        return "bfloat16"
    return stored if stored in DTYPES else "bfloat16"


def _cpu_only() -> None:
    """Compile for the target, never for (or on) a local accelerator: JAX's own backends are the CPU only (the
    GPU / TPU compilers are reached through the topology; JAX starts its backends on first use, after this)."""
    jax.config.update("jax_platforms", "cpu")


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        knobs = execution.from_arguments(args, allowed=KNOBS)
    except ValueError as e:
        raise _Bad(str(e)) from None
    try:
        target = parse_target(args.target)
    except TargetError as e:
        raise _Bad(str(e)) from None
    for field, value in knobs.set_fields().items():  # the native paths are CPU kernels; targets are GPUs and TPUs
        if isinstance(value, str) and value.startswith("native"):
            raise _Bad(f"--{field.replace('_', '-')} {value}: a CPU kernel, and {args.target} is a {target.platform} "
                       "target (expected auto, xla or a path of that platform)")
    config = _read_config(args.model)
    _cpu_only()
    _check_config(config)
    check_deviceless(target)
    log = (lambda msg: print(msg, file=sys.stderr)) if sys.stderr.isatty() else (lambda msg: None)
    try:
        with execution.use_kernels(knobs.kernel_backend):  # the runtime level: every program compiled here
            result = compile_model(config, target, args.batch, args.seq, args.mode,
                                   jnp.dtype(_dtype(config, args.dtype)), log=log, execution=knobs)
    except ValueError as e:  # e.g. experts that the mesh cannot split
        raise _Bad(f"{args.model}: {e}") from None
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    over = [p for p in result["programs"] if not p["fits"]]
    if over:
        p = max(over, key=lambda p: p["bytes_per_device"]["total"])
        n = p["devices_to_fit"]
        fit = (f"about {n} devices of this kind would fit (experts split further)" if n is not None else
               "no device count fits with replicated dense weights")
        if p["compile_errors"]:  # the compiler's own refusal (XLA:TPU: temporaries beyond the HBM)
            fit = f"the compiler refused {p['compile_errors'][0][:200]}; {fit}"
        raise _Bad(f"{p['program']} needs {gib(p['bytes_per_device']['total'])} GiB per device, "
                   f"{target.spelling} has {gib(result['hbm_bytes_per_device'])} GiB of HBM per device; {fit}")
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tutel-jax compile`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    try:
        return _run(argv)
    except (_Bad, DevicelessUnavailable) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
