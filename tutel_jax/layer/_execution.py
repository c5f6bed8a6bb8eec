"""How a program runs: `Execution`, the record of every "how it runs" knob, and the command-line flags built from it.

`Execution` is the record of every "how it runs" knob (kernel backend, dropless path, dense path, dropless
exchange, per-layer programs, all_to_all overlap, 2DH, adaptive r), validated once; `Execution.over(*lower)`
applies the precedence field by field (None: not set at this level), and `add_arguments` / `from_arguments`
give every command (`serve`, `generate`, `compile`, `examples/train_lm.py`) the same flags from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..core import (KERNEL_BACKENDS, PLATFORMS, check_kernel_backend, kernels, platform, use_kernels,
                    DROPLESS_EXCHANGES)
from ..experts import impl_names, DENSE_IMPLS
from ..native import ATTENTION_IMPLS
from ..validation import check_choice, check_int

__all__ = ["KERNEL_BACKENDS", "PLATFORMS", "PER_LAYER_JIT", "MODEL_KNOBS", "Execution", "add_arguments", "from_arguments",
           "check_kernel_backend", "kernels", "platform", "use_kernels"]

#: the knobs a loaded model applies (`from_pretrained`'s arguments); the others are expert-parallel training's
MODEL_KNOBS = ("kernel_backend", "dropless_impl", "dense_impl", "attention_impl", "per_layer_jit")
#: command-line spellings of `per_layer_jit` ('auto': one program per kind of layer from 32 layers on)
PER_LAYER_JIT = {"auto": "auto", "on": True, "off": False}


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a model or layer runs, every knob in one validated record; None means "not set here" (the next level
    of call > runtime > config > default decides), and "auto" means the same as None.

    Attributes:
      kernel_backend: see the module docstring (`kernels`).
      dropless_impl: capacity_factor == 0 on one device: 'auto' or a registered path ('ragged', 'bucketed',
        'loop', 'gather', 'native', 'native_int8'; `tutel_jax.experts._dropless`).
      dense_impl: the dense projections of models: 'auto', 'xla', 'native' or 'native_int8'
        (`tutel_jax.experts._linear`).
      attention_impl: a model's decode-step attention: 'auto', 'xla' or 'native' (`native.attends_natively`).
      dropless_exchange: how a dropless plan crosses devices: one of call_options.DROPLESS_EXCHANGES.
      per_layer_jit: models: one compiled program per kind of layer (True), one for the whole model (False), or
        'auto' (per layer from 32 layers on).
      a2a_ffn_overlap_degree: chunks of the capacity axis for all_to_all / expert overlap (>= 1).
      use_2dh: hierarchical all_to_all over a (node, local) pair of expert axes.
      adaptive_r: Tutel's r for experts shared by several devices (0 or a divisor of the sharded count).
    """

    kernel_backend: str | None = None
    dropless_impl: str | None = None
    dense_impl: str | None = None
    attention_impl: str | None = None
    dropless_exchange: str | None = None
    per_layer_jit: bool | str | None = None
    a2a_ffn_overlap_degree: int | None = None
    use_2dh: bool | None = None
    adaptive_r: int | None = None

    def __post_init__(self):
        check_kernel_backend(self.kernel_backend)
        check_choice(self.dropless_impl, "dropless_impl", impl_names(), optional=True)
        check_choice(self.dense_impl, "dense_impl", DENSE_IMPLS, optional=True)
        check_choice(self.attention_impl, "attention_impl", ATTENTION_IMPLS, optional=True)
        check_choice(self.dropless_exchange, "dropless_exchange", DROPLESS_EXCHANGES, optional=True)
        if self.per_layer_jit is not None and self.per_layer_jit not in (True, False, "auto"):
            raise ValueError(f"per_layer_jit must be True, False or 'auto', got {self.per_layer_jit!r}")
        check_int(self.a2a_ffn_overlap_degree, "a2a_ffn_overlap_degree", minimum=1, optional=True)
        check_int(self.adaptive_r, "adaptive_r", minimum=0, optional=True)
        if self.use_2dh is not None and not isinstance(self.use_2dh, bool):
            raise ValueError(f"use_2dh must be True or False, got {self.use_2dh!r}")

    def over(self, *lower: "Execution") -> "Execution":
        """This record's set fields, then each lower level's in turn (e.g. `call.over(runtime, config)`)."""
        values = {}
        for field in dataclasses.fields(self):
            chain = (getattr(level, field.name) for level in (self, *lower))
            values[field.name] = next((v for v in chain if v is not None and v != "auto"), None)
        return Execution(**values)

    def set_fields(self) -> dict[str, Any]:
        """{field: value} of the fields set (not None / 'auto')."""
        return {f.name: v for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) is not None and v != "auto"}


#: (flag, field, help) of the command-line face of `Execution`
_FLAGS = (
    ("--kernel-backend", "kernel_backend",
     "MoE kernels: auto (default: the kernels of the platform the program is compiled for), xla, pallas, "
     "interpret, tpu, tpu_interpret"),
    ("--dropless-impl", "dropless_impl",
     ("dropless MoE path: auto (default), ragged, bucketed, loop, gather, native, native_int8 (FP4 experts times "
      "int8 activations)")),
    ("--dense-impl", "dense_impl",
     ("dense projections: auto (default), xla, native (CPU kernel for a few rows), native_int8 (FP4 weights "
      "times int8 activations)")),
    ("--attention-impl", "attention_impl",
     "decode-step attention: auto (default), xla, native (CPU kernel: cache update and attention in one call)"),
    ("--dropless-exchange", "dropless_exchange",
     f"how a dropless plan crosses devices: {', '.join(DROPLESS_EXCHANGES)}"),
    ("--per-layer-jit", "per_layer_jit", "one program per kind of layer: auto (default: from 32 layers), on, off"),
    ("--a2a-overlap-degree", "a2a_ffn_overlap_degree", "chunks of the capacity axis overlapping all_to_all (>= 1)"),
    ("--use-2dh", "use_2dh", "hierarchical all_to_all over (node, local) expert axes: on or off"),
    ("--adaptive-r", "adaptive_r", "Tutel's r for experts shared by several devices (0 or a divisor)"),
)


def _parse_field(field: str, text: str) -> Any:
    """One flag's text as the field's value, or argparse.ArgumentTypeError saying what was expected."""
    try:
        if field == "per_layer_jit":
            value = PER_LAYER_JIT[text]
        elif field == "use_2dh":
            value = {"on": True, "off": False}[text]
        elif field in ("a2a_ffn_overlap_degree", "adaptive_r"):
            value = int(text)
        else:
            value = text
        Execution(**{field: value})
    except KeyError:
        expected = {"per_layer_jit": "auto, on or off", "use_2dh": "on or off"}[field]
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {expected}") from None
    except ValueError as e:  # the record's own check says what is expected
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: {e}") from None
    return value


def add_arguments(parser: argparse.ArgumentParser, title: str = "execution") -> None:
    """Adds every Execution knob as a flag (default: not set) in an argument group."""
    group = parser.add_argument_group(title, "how the model runs (unset: the library's default, 'auto')")
    for flag, field, help_text in _FLAGS:
        group.add_argument(flag, dest=f"execution_{field}", default=None, metavar=field.upper(), help=help_text,
                           type=lambda text, field=field: _parse_field(field, text))


def from_arguments(args: argparse.Namespace, allowed: tuple[str, ...] | None = None) -> Execution:
    """The Execution the flags of `add_arguments` set. `allowed`: the fields this command can apply; a flag
    outside them raises ValueError naming it (a knob is never silently ignored)."""
    execution = Execution(**{f.name: getattr(args, f"execution_{f.name}", None)
                             for f in dataclasses.fields(Execution)})
    if allowed is not None:
        for field, value in execution.set_fields().items():
            if field not in allowed:
                flag = next(flag for flag, name, _ in _FLAGS if name == field)
                raise ValueError(f"{flag} does not apply here: this command runs {', '.join(allowed)}")
    return execution
